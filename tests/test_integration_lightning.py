"""Lightning with ``RewriterCallback``: a real ``lightning.Trainer``, a tiny attention model, CPU.

A plain run and a run with the callback, from the same seed and data order, no dropout; the
per-step loss (fp32 tolerance), learning rate, step count, logged metrics and checkpoints are
compared. The clock is controlled (fuse_attention and the fused optimizer look faster).
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tests.controlled import QUICK, ControlledClock
from tests.helpers import assert_trainer_ran_rewritten, logged_messages, unhurried
from tests.factories.tiny_models import DIM, SEQ, AttentionBlock

L = pytest.importorskip("lightning")

from rewriter.integrations.lightning import RewriterCallback  # noqa: E402

STEPS, SAVE_EVERY, BATCH = 4, 2, 2
FASTER = {"fuse_attention": 0.5, "fuse_optimizer": 0.25}


class TinyModule(L.LightningModule):
    """An attention block regressing a fixed target; SGD (for-loop) with a per-step schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = AttentionBlock()
        self.losses: list[torch.Tensor] = []
        self.lrs: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        # SGD, so that checkpoints compare in fp32 tolerance: the key bias has an analytically
        # zero gradient (softmax ignores a shift shared by all keys), and Adam would normalise
        # its rounding noise, different in any two fp32 runs, into full-size updates.
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, foreach=False)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * 2 * STEPS, SEQ, DIM, generator=g)
    y = torch.randn(BATCH * 2 * STEPS, SEQ, DIM, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH,
                                       shuffle=False)


def _fit(root: pathlib.Path, callbacks=()) -> tuple[L.Trainer, TinyModule]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=root,
                        callbacks=[checkpoints, *callbacks])
    module = TinyModule()
    trainer.fit(module, train_dataloaders=_loader())
    return trainer, module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plain = _fit(tmp_path_factory.mktemp("plain"))
    callback = RewriterCallback(clock=ControlledClock(FASTER), gate=QUICK, profile=False,
                                progress=False, knowledge_base=False)
    with logged_messages("rewriter.integrations.lightning") as log, unhurried():
        rewritten = _fit(tmp_path_factory.mktemp("rewritten"), [callback])
    return {"plain": plain, "rewritten": rewritten, "callback": callback,
            "log": log}


def test_training_step_is_rewritten_and_the_loss_matches_step_by_step(runs):
    (_, plain), (_, rewritten), callback = runs["plain"], runs["rewritten"], runs["callback"]
    assert_trainer_ran_rewritten(callback, "TinyModule", plain, rewritten, STEPS)


def test_configure_optimizers_optimizer_is_switched_in_place_and_schedules_alike(runs):
    (plain_trainer, plain), (trainer, rewritten) = runs["plain"], runs["rewritten"]
    opt = trainer.optimizers[0]
    assert all(g["fused"] for g in opt.param_groups)
    assert not any(g["fused"] for g in plain_trainer.optimizers[0].param_groups)
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is opt
    assert rewritten.lrs == plain.lrs and len(plain.lrs) == STEPS


def test_nothing_else_about_the_trainer_changes(runs):
    (plain_trainer, _), (trainer, module) = runs["plain"], runs["rewritten"]
    assert trainer.global_step == plain_trainer.global_step == STEPS
    # self.log calls made while measuring were dropped: the epoch's mean is the plain run's
    for key in ("train_loss_step", "train_loss_epoch"):
        torch.testing.assert_close(trainer.callback_metrics[key], plain_trainer.callback_metrics[key])
    names = lambda t: sorted(p.name for p in (pathlib.Path(t.default_root_dir) / "ckpt").glob("*.ckpt"))  # noqa: E731
    assert names(trainer) == names(plain_trainer) and len(names(trainer)) == STEPS // SAVE_EVERY
    # after fit() the module is the plain module again
    assert "training_step" not in module.__dict__ and "log" not in module.__dict__


def test_report_is_logged_and_saved_under_the_root_dir(runs):
    (trainer, _), callback = runs["rewritten"], runs["callback"]
    assert any("rewriter kept" in m and "fuse_attention" in m for m in runs["log"])
    directory = pathlib.Path(trainer.default_root_dir) / "rewriter"
    saved = json.loads((directory / "report.json").read_text())
    assert saved["kept_passes"] == callback.report.kept_passes
    assert (directory / "report.md").exists()
    assert [c for c in trainer.callbacks if isinstance(c, RewriterCallback)] == [callback]


def test_a_checkpoint_saved_mid_run_loads_into_the_plain_class(runs):
    (trainer, _), (plain_trainer, _) = runs["rewritten"], runs["plain"]
    mid = f"epoch=0-step={SAVE_EVERY}.ckpt"
    got = torch.load(pathlib.Path(trainer.default_root_dir) / "ckpt" / mid, weights_only=True)["state_dict"]
    want = torch.load(pathlib.Path(plain_trainer.default_root_dir) / "ckpt" / mid, weights_only=True)["state_dict"]
    fresh = TinyModule()
    fresh.load_state_dict(got)  # strict: the same keys as the plain class
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"{name}: {m}")


def test_manual_optimization_is_left_alone_with_the_reason(tmp_path):
    class Manual(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = F.mse_loss(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            pass

    callback = RewriterCallback(profile=False, progress=False, knowledge_base=False)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[callback])
    trainer.fit(Manual(), train_dataloaders=_loader())
    assert trainer.global_step == 1
    assert callback.report is None and "manual optimization" in callback.error


def test_optimize_leaves_no_lightning_compile_attribute_on_the_model():
    """Importing lightning replaces torch.compile by a wrapper that writes ``_compile_kwargs``
    onto the compiled module, i.e. onto the user's model; rewriter's capture uses torch's own."""
    import rewriter
    assert hasattr(torch.compile, "__wrapped__")  # lightning's wrapper is in place
    model = AttentionBlock().train()
    before = sorted(vars(model))
    rewriter.optimize(model, (torch.randn(2, SEQ, DIM),), front_end="dynamo", passes=["fuse_attention"],
                      loss_fn=lambda out: out.sum(), gate=QUICK, clock=ControlledClock(FASTER),
                      profile=False, progress=False)
    # torch.compile marks the module it wraps with ``_is_torch_compile`` (torch's own doing)
    assert sorted(k for k in vars(model) if k != "_is_torch_compile") == before


def test_the_estimated_stepping_batches_are_the_run_length_a_compile_is_weighed_against(runs):
    row = next(d for d in runs["callback"].report.decisions if d.pass_name == "compile")
    assert row.status == "not tried" and row.measurement["steps"] == STEPS  # max_steps=STEPS
