"""One plan for every rank: rank 0 measures and decides, the others replay its plan.

Different graphs on different ranks would hang collectives (one rank all-reducing a gradient
another rank no longer has), so under ``torch.distributed`` every rank must run the same
rewrites. The plan travels as JSON bytes in a tensor (no pickling, unlike
``broadcast_object_list``)::

    plan = share_plan(plan_on_rank0_or_None)    # every rank returns rank 0's plan

Optimize the bare model on every rank, then wrap it in DDP/FSDP2: measuring runs no
collectives, so rank 0 can measure while the others wait here. A model already sharded by FSDP2
is decided on its gathered parameters (:mod:`rewriter.devices.gathered`: every rank gathers them
once, then no forward or backward is a collective); one wrapped in the older FSDP
(``FullyShardedDataParallel``) is refused on every rank (:func:`check_not_sharded`) instead of
hanging.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist


def is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sharded_by(model: torch.nn.Module) -> str | None:
    """Which sharding wrapper already holds ``model``'s parameters ("FSDP2 (fully_shard)",
    "FSDP"), or None. Such a model gathers its parameters at every forward, a collective."""
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch
        FSDPModule = ()  # noqa: N806
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover
        FSDP1 = ()  # noqa: N806
    found = None
    for m in model.modules():
        if FSDP1 and isinstance(m, FSDP1):
            return "FSDP"
        if FSDPModule and isinstance(m, FSDPModule):
            found = "FSDP2 (fully_shard)"
    return found


def check_not_sharded(model: torch.nn.Module) -> None:
    """Refuse, on every rank alike (no collective is needed to decide it), a model wrapped in the
    older FSDP: rank 0 would gather parameters alone while the others wait for its plan (FSDP2
    models are gathered on every rank first, :mod:`rewriter.devices.gathered`)."""
    by = sharded_by(model) if is_multi_rank() else None
    if by == "FSDP":
        raise ValueError(
            "the model is already sharded by FSDP (FullyShardedDataParallel): optimize() it "
            "before wrapping it, as in `fast = rewriter.optimize(model, ...)` then wrap, or "
            "shard it with FSDP2's fully_shard(), which optimize() can decide on. Sharded, "
            "every forward gathers parameters (a collective), and rank 0 would run those alone "
            "while the other ranks wait for its decisions")


def rank() -> int:
    return dist.get_rank() if is_multi_rank() else 0


def _device_for(group_backend: str) -> torch.device:
    if group_backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if group_backend == "hccl":
        return torch.device("npu")
    return torch.device("cpu")


def share_plan(plan: dict | None) -> dict:
    """Broadcast rank 0's plan (a JSON-able dict) to every rank; returns it on all ranks."""
    device = _device_for(dist.get_backend())
    if dist.get_rank() == 0:
        if plan is None:
            raise ValueError("rank 0 must provide the plan to share")
        payload = torch.tensor(list(json.dumps(plan).encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    return json.loads(bytes(payload.cpu().tolist()).decode())
