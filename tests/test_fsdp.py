"""FSDP2 (``fully_shard``) on two CPU processes (gloo): the block rewrites run under sharding.

optimize() first, then ``fully_shard`` on each block and the root, as torchtitan and the FSDP2
docs do: rank 0 decides on the plain model, rank 1 replays its plan, and the rewrite installed
in the block class runs inside FSDP2's pre/post-forward (all-gather, reshard) on every rank.
The losses equal those of the same model trained with eager FSDP2 in the same processes.

The other order (sharded, then optimize()) is refused on every rank with a clear error: FSDP2
gathers parameters at every forward, a collective rank 0 cannot run alone while deciding.
"""
from __future__ import annotations

import copy
import datetime
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


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
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
        runs_before = sum(s.runs for s in cap.slots if s.block)
        losses = _train(fast, model, rank)
        runs = sum(s.runs for s in cap.slots if s.block) - runs_before
        eager_losses = _train(eager, eager, rank)
        result = {"kept": fast.report.kept_passes, "clock_calls": clock.calls,
                  "statuses": {d.pass_name: d.status for d in fast.report.decisions},
                  "block_graph_runs": runs, "losses": losses, "eager_losses": eager_losses,
                  "graph_code": "".join(v for k, v in fast.graph_code().items() if "." in k)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
        gc.collect()
    finally:
        dist.destroy_process_group()


def _shard_then_optimize(rank: int, port: int, out_dir: str) -> None:
    import rewriter

    _join(rank, port)
    try:
        model = _shard(_stack().train())
        try:
            rewriter.optimize(model, (torch.randn(2, 16, 32),), loss_fn=lambda out: out.pow(2).mean(),
                              progress=False, profile=False, knowledge_base=False)
            error = None
        except ValueError as e:
            error = str(e)
        losses = _train(model, model, rank)  # the model is untouched and trains as before
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"error": error, "losses": losses}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


def test_optimize_then_fully_shard_runs_the_block_rewrite_on_every_rank(tmp_path):
    zero, one = run_ranks(_optimize_then_shard, tmp_path, world=WORLD, join_seconds=JOIN_SECONDS)
    assert zero["statuses"]["fuse_attention"] == "kept" and zero["clock_calls"] > 0
    assert one["statuses"] == {"fuse_attention": "replayed"} and one["clock_calls"] == 0
    assert zero["kept"] == one["kept"] == ["fuse_attention"]
    assert one["graph_code"] == zero["graph_code"] and "scaled_dot_product_attention" in zero["graph_code"]
    for r in (zero, one):
        assert r["block_graph_runs"] >= 2 * STEPS  # both sharded blocks ran the rewritten graph
        torch.testing.assert_close(r["losses"], r["eager_losses"], rtol=1e-5, atol=1e-6)


def test_fully_shard_then_optimize_is_refused_on_every_rank_without_hanging(tmp_path):
    ranks = run_ranks(_shard_then_optimize, tmp_path, world=WORLD, join_seconds=JOIN_SECONDS)
    for r in ranks:
        assert r["error"] and "fully_shard" in r["error"] and "before" in r["error"]
        assert len(r["losses"]) == STEPS
