"""Hugging Face ``Trainer`` with ``RewriterCallback``: a real Trainer, a tiny GPT-2, CPU.

Two runs from the same seed, the same data order and no dropout, one plain and one with the
callback, and everything Trainer does is compared step by step: the loss (fp32 tolerance), the
learning rate, the number of steps, the checkpoints. The clock is controlled (fuse_attention and
the fused optimizer look faster), so what is kept does not depend on this machine's timing.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from tests.controlled import QUICK, ControlledClock
from tests.helpers import assert_trainer_ran_rewritten, logged_messages, unhurried

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from rewriter.integrations.transformers import RewriterCallback  # noqa: E402

SEQ, VOCAB, LAYERS, STEPS, SAVE_EVERY = 16, 64, 2, 4, 2
FASTER = {"fuse_attention": 0.5, "fuse_optimizer": 0.25}


def _model() -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=SEQ, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def _dataset() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (8 * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


class RecordingTrainer(transformers.Trainer):
    """Trainer as it is, keeping each step's loss unrounded (``log_history`` rounds it)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append((result[0] if return_outputs else result).detach().clone())
        return result


class SeenOptimizer(transformers.TrainerCallback):
    """The torch optimizer Trainer built, as it was when training began."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer = optimizer.optimizer  # inside accelerate's AcceleratedOptimizer


def _train(out_dir, callbacks=(), resume=None) -> RecordingTrainer:
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1, optim="adamw_torch",
        logging_steps=1, save_strategy="steps", save_steps=SAVE_EVERY, use_cpu=True, seed=0,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    trainer = RecordingTrainer(model=_model(), args=args, train_dataset=_dataset(),
                               callbacks=list(callbacks))
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _callback(**extra) -> RewriterCallback:
    # knowledge_base=False: the module-scoped runs come before the per-test private knowledge base
    return RewriterCallback(clock=ControlledClock(FASTER), gate=QUICK, profile=False,
                            progress=False, knowledge_base=False, **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plain = _train(tmp_path_factory.mktemp("plain"))
    seen, callback = SeenOptimizer(), _callback()
    with logged_messages("rewriter.integrations.transformers") as log, unhurried():
        rewritten = _train(tmp_path_factory.mktemp("rewritten"), [seen, callback])
    return {"plain": plain, "rewritten": rewritten, "callback": callback, "seen": seen,
            "log": log}


def _learning_rates(trainer) -> list[float]:
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


def _checkpoints(trainer) -> list[str]:
    return sorted(p.name for p in pathlib.Path(trainer.args.output_dir).glob("checkpoint-*"))


def test_trainer_loss_matches_the_plain_run_step_by_step(runs):
    plain, rewritten, callback = runs["plain"], runs["rewritten"], runs["callback"]
    # every training step after the first batch's decision ran the rewritten graphs
    assert_trainer_ran_rewritten(callback, "GPT2LMHeadModel", plain, rewritten, STEPS)


def test_the_optimizer_trainer_built_is_switched_in_place(runs):
    seen, rewritten = runs["seen"], runs["rewritten"]
    assert rewritten.optimizer.optimizer is seen.optimizer
    assert all(g["fused"] for g in seen.optimizer.param_groups)
    assert not any(g.get("fused") for g in runs["plain"].optimizer.optimizer.param_groups)
    # the scheduler Trainer made drives that same object
    assert rewritten.lr_scheduler.optimizer.optimizer is seen.optimizer


def test_nothing_else_about_the_trainer_changes(runs):
    plain, rewritten = runs["plain"], runs["rewritten"]
    assert rewritten.state.global_step == plain.state.global_step == STEPS
    assert _learning_rates(rewritten) == _learning_rates(plain) and len(_learning_rates(plain)) == STEPS
    assert [h.get("step") for h in rewritten.state.log_history] == \
        [h.get("step") for h in plain.state.log_history]
    assert _checkpoints(rewritten) == _checkpoints(plain) == ["checkpoint-2", "checkpoint-4"]
    # after train() the model is the plain model again
    assert "forward" not in rewritten.model.__dict__


def test_report_is_logged_and_saved_in_the_output_directory(runs):
    callback, rewritten = runs["callback"], runs["rewritten"]
    assert any("rewriter kept" in m and "fuse_attention" in m for m in runs["log"])
    directory = pathlib.Path(rewritten.args.output_dir) / "rewriter"
    saved = json.loads((directory / "report.json").read_text())
    assert saved["kept_passes"] == callback.report.kept_passes
    assert "fuse_attention" in (directory / "report.md").read_text()
    # and from the trainer object itself
    found = [c for c in rewritten.callback_handler.callbacks if isinstance(c, RewriterCallback)]
    assert found == [callback] and found[0].report is callback.report


def test_a_checkpoint_saved_mid_run_loads_into_the_plain_class_and_back(runs, tmp_path):
    mid = f"checkpoint-{SAVE_EVERY}"
    got = transformers.GPT2LMHeadModel.from_pretrained(pathlib.Path(runs["rewritten"].args.output_dir) / mid)
    want = transformers.GPT2LMHeadModel.from_pretrained(pathlib.Path(runs["plain"].args.output_dir) / mid)
    assert type(got) is transformers.GPT2LMHeadModel
    assert list(got.state_dict()) == list(want.state_dict())
    for (name, g), w in zip(got.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")
    # ... and back: the plain run's checkpoint resumes with the callback on (replaying the plan
    # the first run saved, so nothing is measured again), and the remaining steps match the
    # plain run's
    plan = pathlib.Path(runs["rewritten"].args.output_dir) / "rewriter" / "plan.json"
    callback = _callback(plan=str(plan))
    resumed = _train(tmp_path, [callback], resume=str(pathlib.Path(runs["plain"].args.output_dir) / mid))
    assert callback.report.kept_passes == runs["callback"].report.kept_passes
    assert "replayed" in callback.report.plan_status
    assert resumed.state.global_step == STEPS and len(resumed.losses) == STEPS - SAVE_EVERY
    torch.testing.assert_close(torch.stack(resumed.losses), torch.stack(runs["plain"].losses[SAVE_EVERY:]))


def test_unknown_or_trainer_owned_options_are_refused():
    with pytest.raises(TypeError, match="unknown optimize\\(\\) option 'min_sppedup'"):
        RewriterCallback(min_sppedup=1.1)
    with pytest.raises(TypeError, match="'optimizer' is taken from the trainer"):
        RewriterCallback(optimizer=None)


def test_the_trainer_s_max_steps_is_the_run_length_a_compile_is_weighed_against(runs):
    row = next(d for d in runs["callback"].report.decisions if d.pass_name == "compile")
    # a tiny model's step cannot repay Inductor's seconds within STEPS steps: not even tried
    assert row.status == "not tried" and row.measurement["steps"] == STEPS
