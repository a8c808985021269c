"""``F.linear`` in fp32 on CPU run by oneDNN, forward and backward, as three custom ops.

Stock torch runs an fp32 ``F.linear`` on CPU as an MKL sgemm (bf16 already goes to oneDNN).
MKL picks its kernels by the CPU it finds; on an AMD EPYC with AVX-512 (family 26, 2 cores,
torch 2.13's MKL 2024.2) its sgemm runs at ~200 GFLOP/s at every shape of a small
transformer, oneDNN's fp32 matmul at ~400 (``torch.ops.mkldnn._linear_pointwise``: [1024, 256]
x [256, 8000] 22.4 -> 11.2 ms; the weight-gradient form, contracting over tokens, 20.8 -> 15.6
ms). On an Intel Xeon MKL is at home and the two may be level: ``passes/onednn_linear.py``
rewrites, the gate keeps it where it measures faster::

    y = linear(x, w, b)             # == F.linear(x, w, b); fp32 CPU tensors through oneDNN

The ops are ``torch.library`` custom ops, so Dynamo and Inductor see one opaque call each (with
a fake kernel for shapes) and a compiled graph keeps them: Inductor's own lowering of
``_linear_pointwise`` assumes a frozen (constant) weight and fails on a trained one.
Backward: ``grad_input = g @ w`` and ``grad_weight = g^T @ x`` as oneDNN linears on transposed
views (no copies), ``grad_bias = g.sum(0)``. Anything but fp32 CPU tensors of matching shapes
(bf16, float64, CUDA, an empty input) is F.linear, unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_NAMESPACE = "rewriter"
# fixed for the build: read once, so a traced call guards on tensors only
_BUILT_WITH = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def unavailable() -> str | None:
    """Why the oneDNN linear cannot run here, or None when it can."""
    if not _BUILT_WITH:
        return "this torch is built without oneDNN's linear (torch.ops.mkldnn._linear_pointwise)"
    if not torch.backends.mkldnn.enabled:
        return "oneDNN is disabled (torch.backends.mkldnn.enabled is False)"
    return None


def _onednn(x2: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``x2 @ w.T + b`` by oneDNN; ``x2`` 2-D, ``w`` 2-D (either may be a transposed view)."""
    return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")


# The ops take and return 2-D tensors: a custom op's output must not be a view (autograd would
# refuse an in-place op on it, as Falcon's ``x += bias`` does), so the reshapes are outside.
@torch.library.custom_op(f"{_NAMESPACE}::onednn_linear", mutates_args=())
def _linear_op(x2: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    return _onednn(x2, w, b)


@_linear_op.register_fake
def _(x2: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    return x2.new_empty((x2.shape[0], w.shape[0]))


@torch.library.custom_op(f"{_NAMESPACE}::onednn_linear_grad_input", mutates_args=())
def _grad_input(g2: Tensor, w: Tensor) -> Tensor:
    """``g2 @ w``: a linear whose weight is ``w``'s transposed view."""
    return _onednn(g2, w.t(), None)


@_grad_input.register_fake
def _(g2: Tensor, w: Tensor) -> Tensor:
    return g2.new_empty((g2.shape[0], w.shape[1]))


@torch.library.custom_op(f"{_NAMESPACE}::onednn_linear_grad_weight", mutates_args=())
def _grad_weight(g2: Tensor, x2: Tensor) -> Tensor:
    """``g2^T @ x2`` over every token: a linear of ``g2``'s transposed view by ``x2``'s."""
    return _onednn(g2.t(), x2.t(), None)


@_grad_weight.register_fake
def _(g2: Tensor, x2: Tensor) -> Tensor:
    return g2.new_empty((g2.shape[1], x2.shape[1]))


def _setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x2, w, b = inputs
    ctx.save_for_backward(x2, w)
    ctx.has_bias = b is not None


def _backward(ctx: Any, g2: Tensor) -> tuple[Tensor | None, ...]:
    x2, w = ctx.saved_tensors
    gx = _grad_input(g2, w) if ctx.needs_input_grad[0] else None
    gw = _grad_weight(g2, x2) if ctx.needs_input_grad[1] else None
    gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gx, gw, gb


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def runs_on_onednn(x: Tensor, w: Tensor, b: Tensor | None = None) -> bool:
    """Whether :func:`linear` takes these tensors to oneDNN (else it is F.linear)."""
    tensors = (x, w) if b is None else (x, w, b)
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.layout == torch.strided
                for t in tensors)
            and w.ndim == 2 and x.ndim >= 1 and x.shape[-1] == w.shape[1] and x.numel() > 0
            and (b is None or b.shape == (w.shape[0],)) and _BUILT_WITH)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, b)``, by oneDNN for fp32 CPU tensors (module docstring), else F.linear."""
    if not runs_on_onednn(x, w, b):
        return F.linear(x, w, b)
    if x.ndim == 2:
        return _linear_op(x, w, b)
    return _linear_op(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])
