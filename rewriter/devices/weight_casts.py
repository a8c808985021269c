"""Model weights cast to the half dtype once for inference, not at every call.

cast_to_half writes ``w.to(bf16)`` before each half-precision GEMM. In training that cast is
part of the step: the weight changes every step and its gradient flows back through the cast.
In inference the weight does not change from call to call, yet the cast reads every fp32 weight
and writes a half copy at every call: a one-token decode call of a small model spends more on
those casts than on its GEMMs (Qwen2, 3 layers, hidden 384, generate: cast_to_half measured
0.53x). There cast_to_half casts a model tensor through a ``WeightCast`` module instead: the
half copy is made at the first call and reused while the weight is the same tensor, unchanged
(its version counter: an in-place update, ``load_state_dict`` included, makes a new copy)::

    cast = WeightCast(torch.bfloat16)
    with torch.no_grad():
        w16 = cast(w)        # made once, then the same tensor while w is unchanged
    w16 = cast(w)            # grad enabled, or inside a trace or compile: w.to(bf16), as written

The copies live as long as the rewritten graph holding the module (optimize()'s model) and the
weights they were made from. They cost the weights' bytes in the half dtype: the fp32 weights
are the user's and stay as they are.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn


class WeightCast(nn.Module):
    """``w.to(dtype)``, cached per weight while autograd is off (see the module docstring).
    No parameters or buffers: the copies are not part of any ``state_dict``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        # id(weight) -> (weakref to the weight, its version when cast, the cast copy)
        self._casts: dict[int, tuple[Any, int, torch.Tensor]] = {}

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not _cacheable(w, self.dtype):
            return w.to(self.dtype)  # traced: the cast goes into the graph, never a copy of ours
        key = id(w)
        hit = self._casts.get(key)
        if hit is not None and hit[0]() is w and hit[1] == w._version:
            return hit[2]
        with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
            half = w.detach().to(self.dtype)
        casts = self._casts
        self._casts[key] = (weakref.ref(w, lambda _, k=key: casts.pop(k, None)), w._version, half)
        return half

    def extra_repr(self) -> str:
        return f"{self.dtype}, {len(self._casts)} weight(s) cast"

    def cached_bytes(self) -> int:
        """Bytes the cast copies hold."""
        return sum(t.numel() * t.element_size() for _, _, t in self._casts.values())


def _cacheable(w: Any, dtype: torch.dtype) -> bool:
    """A real weight, cast with autograd off, outside any trace: Dynamo's, AOTAutograd's
    (``make_fx``: fake, functional or proxy tensors; a copy of ours would be baked into the
    graph as a constant) or ``torch.fx``'s (a Proxy)."""
    return (type(w) in (torch.Tensor, nn.Parameter) and w.dtype != dtype and not w.is_inference()
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not _in_a_trace())


def _in_a_trace() -> bool:
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    if keys is None:  # pragma: no cover - a torch without dispatch-mode keys
        return False
    return any(torch._C._get_dispatch_mode(getattr(keys, name)) is not None
               for name in ("PROXY", "FAKE", "FUNCTIONAL") if hasattr(keys, name))


def copies_held(slots: list[Any], dtype: torch.dtype) -> str | None:
    """The report's note on the half copies the kept graphs' weight casts hold (inference), or
    None when they hold none."""
    found = {id(m): m for slot in slots for gm in (slot.kept, slot.kept_run)
             for m in gm.modules() if isinstance(m, WeightCast)}
    held = sum(m.cached_bytes() for m in found.values())
    if not held:
        return None
    size = f"{held / 2**20:.1f} MiB" if held >= 2**20 else f"{held / 2**10:.1f} KiB"
    return (f"inference: cast_to_half holds a {str(dtype).replace('torch.', '')} copy of each weight it "
            f"casts ({size} beside the model's own weights), made at the first call and reused while "
            "the weight is unchanged")
