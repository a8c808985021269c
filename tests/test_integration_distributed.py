"""Hugging Face ``Trainer`` on two CPU processes (accelerate, DDP on gloo) with RewriterCallback.

Each rank is a process of its own, as ``torchrun``/``accelerate launch`` would start it (the
same environment variables). Trainer wraps the model in DistributedDataParallel; the callback
optimizes at the first batch on every rank: rank 0 measures, rank 1 replays rank 0's plan (its
clock is never called), so both run the same graphs, and DDP keeps their parameters identical.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORLD = 2
STEPS = 3
JOIN_SECONDS = 150  # a hung collective fails the test instead of stalling CI


def _train_and_report(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)  # two processes share two cores
    import transformers

    from rewriter.integrations.transformers import RewriterCallback
    from tests.controlled import QUICK, ControlledClock
    from tests.test_integration_transformers import FASTER, SEQ, _dataset, _model

    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
        optim="adamw_torch", use_cpu=True, ddp_backend="gloo", ddp_timeout=120, seed=0,
        save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True)
    clock = ControlledClock(FASTER)  # the same kind on both ranks; only rank 0 may call it
    callback = RewriterCallback(clock=clock, gate=QUICK, profile=False, progress=False,
                                knowledge_base=False)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_dataset(),
                                   callbacks=[callback])
    trainer.train()
    assert dist.is_initialized() and dist.get_world_size() == WORLD
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    report = callback.report
    result = {
        "wrapped": type(trainer.model_wrapped).__name__,
        "error": callback.error,
        "kept": report.kept_passes if report else None,
        "statuses": {d.pass_name: d.status for d in report.decisions} if report else None,
        "clock_calls": clock.calls,
        "rewritten_calls": callback._step.rewritten_calls,
        "graph_code": "".join(callback._step.fast.graph_code().values()) if callback._step.fast else "",
        "identical_across_ranks": all(torch.equal(gathered[0], g) for g in gathered[1:]),
        "steps": trainer.state.global_step,
        "seq": SEQ,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # neither rank leaves while the other is still in a collective


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_every_rank_trains_the_graph_rank0_decided(tmp_path):
    zero, one = run_ranks(_train_and_report, tmp_path, world=WORLD, join_seconds=JOIN_SECONDS)
    assert zero["wrapped"] == one["wrapped"] == "DistributedDataParallel"
    assert zero["error"] is None and one["error"] is None
    assert zero["statuses"]["fuse_attention"] == "kept" and zero["clock_calls"] > 0
    assert one["kept"] == zero["kept"] and "fuse_attention" in one["kept"]
    assert one["clock_calls"] == 0 and set(one["statuses"].values()) == {"replayed"}
    assert one["graph_code"] == zero["graph_code"] and "scaled_dot_product_attention" in zero["graph_code"]
    assert zero["rewritten_calls"] == one["rewritten_calls"] == STEPS
    assert zero["steps"] == one["steps"] == STEPS
    assert zero["identical_across_ranks"] and one["identical_across_ranks"]
