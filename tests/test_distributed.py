"""torch.distributed: rank 0 measures and decides, every rank runs the same rewrites.

Two processes on gloo (CPU), started with the spawn method. Each builds the same model with the
same seed and optimizes it BEFORE wrapping it in DistributedDataParallel: measuring runs no
collectives, so rank 0 measures while rank 1 waits for its plan. Then both train a few DDP
steps on different data; parameters must stay identical across ranks (different graphs on
different ranks would make the all-reduced gradients disagree, or hang).
"""
from __future__ import annotations

import datetime
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import run_ranks

WORLD = 2
STEPS = 3
JOIN_SECONDS = 120  # a hung collective fails the test instead of stalling CI


def _train_and_report(rank: int, port: int, out_dir: str) -> None:
    import rewriter
    from tests.controlled import QUICK, ControlledClock
    from tests.factories.tiny_models import AttentionBlock

    torch.set_num_threads(1)  # two processes share two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)  # the same model and example inputs on every rank
        model = AttentionBlock().train()
        example = torch.randn(2, 16, 32)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
        # Same kind of clock on both ranks; only rank 0 may call it.
        clock = ControlledClock({"fuse_attention": 0.5})
        fast, opt = rewriter.optimize(model, (example,), optimizer=opt, loss_fn=loss_fn,
                                      passes=["fuse_attention", "fuse_linear"], gate=QUICK,
                                      clock=clock, progress=False, profile=False)
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        ddp = torch.nn.parallel.DistributedDataParallel(fast)
        data = torch.Generator().manual_seed(1000 + rank)  # different data per rank
        for _ in range(STEPS):
            loss = loss_fn(ddp(torch.randn(2, 16, 32, generator=data)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        result = {
            "kept": fast.report.kept_passes,
            "statuses": {d.pass_name: d.status for d in fast.report.decisions},
            "plan_status": fast.report.plan_status,
            "clock_calls": clock.calls,
            "identical_across_ranks": all(torch.equal(gathered[0], g) for g in gathered[1:]),
            "trained": not torch.equal(before, flat),
            "graph_code": "".join(fast.graph_code().values()),
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()  # neither rank tears down while the other is still in a collective
        del ddp
        gc.collect()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_rank0_decides_and_every_rank_trains_the_same_graph(tmp_path):
    ranks = run_ranks(_train_and_report, tmp_path, world=WORLD, join_seconds=JOIN_SECONDS)
    zero, one = ranks
    assert zero["statuses"]["fuse_attention"] == "kept" and zero["clock_calls"] > 0
    assert one["kept"] == zero["kept"] == ["fuse_attention"]
    assert one["statuses"] == {"fuse_attention": "replayed"} and one["clock_calls"] == 0
    assert "replayed" in one["plan_status"]
    # The same rewritten graph runs on both ranks, and DDP kept their parameters in step.
    assert one["graph_code"] == zero["graph_code"]
    assert "scaled_dot_product_attention" in zero["graph_code"]
    assert all(r["trained"] and r["identical_across_ranks"] for r in ranks)
