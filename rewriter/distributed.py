"""One plan for every rank: rank 0 measures and decides, the others replay its plan.

Different graphs on different ranks would hang collectives (one rank all-reducing a gradient
another rank no longer has), so under ``torch.distributed`` every rank must run the same
rewrites. The plan travels as JSON bytes in a tensor (no pickling, unlike
``broadcast_object_list``)::

    plan = share_plan(plan_on_rank0_or_None)    # every rank returns rank 0's plan

Optimize the bare model on every rank, then wrap it in DDP/FSDP: measuring runs no collectives,
so rank 0 can measure while the others wait here.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist


def is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
