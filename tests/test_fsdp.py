"""FSDP2 (``fully_shard``) on two CPU processes (gloo): the block rewrites run under sharding.

optimize() first, then ``fully_shard`` on each block and the root, as torchtitan and the FSDP2
docs do: rank 0 decides on the plain model, rank 1 replays its plan, and the rewrite installed
in the block class runs inside FSDP2's pre/post-forward (all-gather, reshard) on every rank.
The losses equal those of the same model trained with eager FSDP2 in the same processes.

The other order (``fully_shard``, then optimize(), as the Trainer callback meets it under
accelerate's FSDP2): every rank gathers the parameters once (rewriter.devices.gathered), rank 0
decides on them with every forward and backward local, the others replay its plan, and the
shards come out untouched and resharded.
"""
from __future__ import annotations

import copy
import datetime
import functools
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.ranks import run_ranks

WORLD = 2
STEPS = 3
JOIN_SECONDS = 150  # a hung collective fails the test instead of stalling CI


def _stack():
    from tests.factories.tiny_models import AttentionBlock

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(AttentionBlock() for _ in range(2))
            self.head = nn.Linear(32, 8)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)
    return Stack()


def _shard(model, root=True):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    if root:
        fully_shard(model)
    return model


def _join(rank, port):
    """This process as one rank of the gloo group, one thread (two ranks share two cores)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)  # the same model and example inputs on every rank


def _train(run, model, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    losses = []
    for _ in range(STEPS):
        loss = run(torch.randn(2, 16, 32, generator=data)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _write(out_dir: str, rank: int, result: dict) -> None:
    """This rank's result for the test, once every rank has one."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


def _train_both(fast, model, eager, cap, clock, rank) -> dict:
    """Train through the optimized model, then the eager FSDP2 copy: what was kept, how often
    the block graphs ran, both losses step by step, the block graphs' code."""
    runs_before = sum(s.runs for s in cap.slots if s.block)
    losses = _train(fast, model, rank)
    runs = sum(s.runs for s in cap.slots if s.block) - runs_before
    return {"kept": fast.report.kept_passes, "clock_calls": clock.calls,
            "statuses": {d.pass_name: d.status for d in fast.report.decisions},
            "block_graph_runs": runs, "losses": losses, "eager_losses": _train(eager, eager, rank),
            "graph_code": "".join(v for k, v in fast.graph_code().items() if "." in k)}


def _optimize_then_shard(rank: int, port: int, out_dir: str) -> None:
    import rewriter
    from tests.controlled import QUICK, ControlledClock

    _join(rank, port)
    try:
        model = _stack().train()
        eager = copy.deepcopy(model)
        clock = ControlledClock({"fuse_attention": 0.5})
        fast = rewriter.optimize(model, (torch.randn(2, 16, 32),), passes=["fuse_attention"],
                                 loss_fn=lambda out: out.pow(2).mean(), gate=QUICK, clock=clock,
                                 progress=False, profile=False, knowledge_base=False,
                                 regional=True)
        cap = fast._outcome.capture
        _shard(model)
        _shard(eager)
        result = _train_both(fast, model, eager, cap, clock, rank)
        _write(out_dir, rank, result)
        gc.collect()
    finally:
        dist.destroy_process_group()


def _shard_then_optimize(rank: int, port: int, out_dir: str, root: bool = True) -> None:
    import rewriter
    from tests.controlled import QUICK, ControlledClock

    _join(rank, port)
    try:
        plain = _stack().train()
        eager = _shard(copy.deepcopy(plain), root)
        model = _shard(plain, root)
        local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
        shards = {n: local(p).clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        clock = ControlledClock({"fuse_attention": 0.5})
        fast, returned = rewriter.optimize(
            model, (torch.randn(2, 16, 32),), optimizer=opt, passes=["fuse_attention"],
            loss_fn=lambda out: out.pow(2).mean(), gate=QUICK, clock=clock, progress=False,
            profile=False, knowledge_base=False, regional=True)
        untouched = all(torch.equal(local(p), shards[n]) and p.grad is None
                        for n, p in model.named_parameters())
        sharded_again = all(type(p).__name__ == "DTensor" for n, p in model.named_parameters()
                            if root or not n.startswith("head."))  # unsharded head: no root
        result = {**_train_both(fast, model, eager, fast._outcome.capture, clock, rank),
                  "blocks": [(b["class"], b["instances"]) for b in fast.report.blocks],
                  "same_optimizer": returned is opt, "notes": fast.report.notes,
                  "untouched": untouched, "sharded_again": sharded_again}
        _write(out_dir, rank, result)
        gc.collect()
    finally:
        dist.destroy_process_group()


def _optimize_inside_a_sharded_forward(rank: int, port: int, out_dir: str) -> None:
    import rewriter

    _join(rank, port)
    try:
        plain = _stack().train()
        eager = _shard(copy.deepcopy(plain))
        model = _shard(plain)
        errors = []

        def optimize_now(module, args):  # runs after FSDP2's own pre-forward (the gathering)
            try:
                rewriter.optimize(model, args, loss_fn=lambda out: out.pow(2).mean(),
                                  progress=False, profile=False, knowledge_base=False)
            except ValueError as e:
                errors.append(str(e))
        model.register_forward_pre_hook(optimize_now)
        losses = _train(model, model, rank)
        _write(out_dir, rank, {"errors": errors, "losses": losses,
                       "eager_losses": _train(eager, eager, rank)})
    finally:
        dist.destroy_process_group()


pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in"),
              pytest.mark.timeout(JOIN_SECONDS + 60)]  # beside run_ranks' own join deadline


def test_optimize_then_fully_shard_runs_the_block_rewrite_on_every_rank(tmp_path):
    zero, one = run_ranks(_optimize_then_shard, tmp_path, world=WORLD, join_seconds=JOIN_SECONDS)
    assert zero["statuses"]["fuse_attention"] == "kept" and zero["clock_calls"] > 0
    assert one["statuses"] == {"fuse_attention": "replayed"} and one["clock_calls"] == 0
    assert zero["kept"] == one["kept"] == ["fuse_attention"]
    assert one["graph_code"] == zero["graph_code"] and "scaled_dot_product_attention" in zero["graph_code"]
    for r in (zero, one):
        assert r["block_graph_runs"] >= 2 * STEPS  # both sharded blocks ran the rewritten graph
        torch.testing.assert_close(r["losses"], r["eager_losses"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("root", [True, False], ids=["blocks_and_root", "blocks_only"])
def test_fully_shard_then_optimize_decides_on_gathered_parameters_on_every_rank(tmp_path, root):
    fn = functools.partial(_shard_then_optimize, root=root)
    zero, one = run_ranks(fn, tmp_path, world=WORLD, join_seconds=JOIN_SECONDS)
    assert zero["statuses"]["fuse_attention"] == "kept" and zero["clock_calls"] > 0
    assert one["statuses"] == {"fuse_attention": "replayed"} and one["clock_calls"] == 0
    assert zero["kept"] == one["kept"] == ["fuse_attention"]
    assert zero["blocks"] == one["blocks"] == [["AttentionBlock", 2]]
    assert one["graph_code"] == zero["graph_code"] and "scaled_dot_product_attention" in zero["graph_code"]
    for r in (zero, one):
        # measuring wrote nothing into the shards, and FSDP2 resharded them
        assert r["untouched"] and r["sharded_again"]
        # the optimizer holds the shards: handed back as it was, and the report says why
        assert r["same_optimizer"] and any("optimizer" in n and "sharded by FSDP2" in n for n in r["notes"])
        assert any(n.startswith("compile: not tried: the model is sharded by FSDP2") for n in r["notes"])
        assert r["block_graph_runs"] >= 2 * STEPS
        torch.testing.assert_close(r["losses"], r["eager_losses"], rtol=1e-5, atol=1e-6)


def test_optimize_inside_a_forward_of_the_sharded_model_is_refused_on_every_rank(tmp_path):
    ranks = run_ranks(_optimize_inside_a_sharded_forward, tmp_path, world=WORLD,
                      join_seconds=JOIN_SECONDS)
    for r in ranks:
        assert len(r["errors"]) == STEPS and "inside a forward" in r["errors"][0]
        # refused before anything was gathered: FSDP2 trains exactly as without the hook
        torch.testing.assert_close(r["losses"], r["eager_losses"], rtol=0, atol=0)
