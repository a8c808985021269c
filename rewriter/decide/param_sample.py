"""The parameters the fused optimizer is decided on: one instance of each distinct block, and
everything outside the blocks.

An optimizer's update is elementwise per parameter: the instances of one repeated block, with the
same parameter shapes and dtypes, cost the same and round the same. Timing and checking the step
over all of them made the optimizer's decision (and its scratch copies of parameters, gradients
and state: twice the model) grow with depth; timed over one instance of each distinct block and
the rest of the model, it costs a fixed share. The sample keeps a realistic working set (the
embeddings and head are in it whole), and the saving it measures is scaled to the whole step by
the parameter count (the update's time is linear in it); the step check confirms the whole::

    sample = sample_parameters(optimizer, model)
    sample.ids        # parameter ids to copy, or None: all of them
    sample.scale      # whole step's elements / the sample's
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from rewriter.capture.blocks import find_blocks

# Below this share of the parameters a sample is worth taking; above it, all of them are used.
MAX_SAMPLE_SHARE = 0.5


@dataclass(frozen=True)
class ParamSample:
    """The parameters (by id) a fused optimizer is decided on, and their share of the whole."""

    ids: frozenset[int] | None  # None: every parameter
    numel: int
    total_numel: int
    description: str = "all parameters"

    @property
    def scale(self) -> float:
        return self.total_numel / self.numel if self.ids is not None and self.numel else 1.0

    def to_dict(self) -> dict:
        return {"parameters": self.numel, "of": self.total_numel, "scale": round(self.scale, 4),
                "description": self.description}


def _layout(m: nn.Module, group_of: dict[int, int]) -> tuple:
    """What an instance's update depends on: for each of its parameters the optimizer holds,
    its name, shape, dtype, device and param group (its hyper-parameters and kernel flags)."""
    return tuple((n, tuple(p.shape), p.dtype, str(p.device), group_of[id(p)])
                 for n, p in m.named_parameters() if id(p) in group_of)


def sample_parameters(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> ParamSample:
    """One instance of each (block class, layout of its optimized parameters) and every
    parameter outside them. Instances the optimizer holds nothing of (frozen layers) are not
    taken for the others."""
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    total = sum(p.numel() for p in params.values())
    whole = ParamSample(None, total, total)
    if model is None or not params:
        return whole
    in_blocks: set[int] = set()
    kept: set[int] = set()  # (a parameter tied across instances is kept if one kept instance has it)
    kept_names = []
    for b in find_blocks(model):
        seen: set[tuple] = set()
        for _, m in b.instances:
            mine = {id(p) for p in m.parameters()}
            in_blocks |= mine
            layout = _layout(m, group_of)
            if layout and layout not in seen:
                seen.add(layout)
                kept |= mine
        kept_names.append(f"{len(seen)} of {len(b.instances)} {b.name}")
    ids = frozenset(i for i in params if i not in in_blocks or i in kept)
    numel = sum(params[i].numel() for i in ids)
    if not ids or numel > MAX_SAMPLE_SHARE * total:
        return whole
    return ParamSample(ids, numel, total, f"{', '.join(kept_names)} and the parameters outside "
                       f"the blocks: {numel / 1e6:.3g}M of {total / 1e6:.3g}M parameters")
