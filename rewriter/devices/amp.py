"""Mixed precision: which operators run in the half dtype, which stay fp32, and loss scaling.

The two lists follow autocast's: GEMM-like operators gain from half precision (NPU Cube
units, CPU AMX, GPU tensor cores); reductions, norms, exp/log and losses lose accuracy in it.
They are the user's to change, as with apex's ``amp.register_half_function``::

    rewriter.devices.amp.register_half_function(torch, "bmm")      # force bmm to half
    rewriter.devices.amp.register_float_function(torch, "bmm")     # force bmm to fp32
    rewriter.devices.amp.register_float_function(my_module, "my_op")

fp16 training gets dynamic loss scaling without a change to the user's loop: the optimized
model scales the gradient flowing back from its outputs, and the optimizer's ``step`` unscales,
skips the step on overflow and backs the scale off, as ``torch.amp.GradScaler`` does.
"""
from __future__ import annotations

import logging
import types
from typing import Any, Callable

import torch
from torch.fx import Node

from rewriter.capture.ir import op_name

log = logging.getLogger(__name__)

# Canonical op names (rewriter.capture.ir.op_name) or callables.
HALF_OPS: set[Any] = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv",
                      "scaled_dot_product_attention"}  # autocast's GEMMs (it lists mm too)
FLOAT_OPS: set[Any] = {"softmax", "log_softmax", "layer_norm", "rms_norm", "batch_norm",
                       "group_norm", "exp", "log", "log1p", "pow", "rsqrt", "sum", "mean", "var",
                       "cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy_with_logits",
                       "cumsum", "norm", "softplus"}
# What the user forced, for the report.
FORCED: dict[Any, str] = {}


def masked_fill_saturated(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``x.masked_fill(mask, value)`` with ``value`` saturated to ``x``'s dtype: what a model that
    writes ``torch.finfo(x.dtype).min`` fills with in the dtype it runs in (rewriter's graphs are
    captured in fp32, so that value is fp32's; in bf16 it does not fit, and masked_fill raises)."""
    return x.masked_fill(mask, _saturated(value, x))


def masked_fill_saturated_(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """In place: :func:`masked_fill_saturated`."""
    return x.masked_fill_(mask, _saturated(value, x))


def _saturated(value: float, x: torch.Tensor) -> float:
    if not x.is_floating_point():
        return value
    info = torch.finfo(x.dtype)
    return min(max(value, info.min), info.max)


# fill operators whose scalar may be a dtype's extreme, their value's position, and the form that
# saturates it to the tensor's dtype at run time (cast_to_half)
SATURATED_FILLS: dict[str, tuple[int, Callable[..., Any]]] = {
    "masked_fill": (2, masked_fill_saturated),
    "masked_fill_": (2, masked_fill_saturated_),
}


def _key(module: Any, name: str) -> Any:
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{getattr(module, '__name__', module)!r} has no attribute {name!r}")
    return name if name in _CANONICAL else fn


_CANONICAL = HALF_OPS | FLOAT_OPS | {"embedding", "gelu", "silu", "tanh", "sigmoid", "add", "mul"}


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the half dtype (taken off the fp32 list if it was there)."""
    key = _key(module, name)
    FLOAT_OPS.discard(key)
    HALF_OPS.add(key)
    FORCED[key] = "half"


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` in fp32 (taken off the half list if it was there)."""
    key = _key(module, name)
    HALF_OPS.discard(key)
    FLOAT_OPS.add(key)
    FORCED[key] = "float"


def precision_of(node: Node) -> str | None:
    """"half", "float" or None (follows its inputs) for a graph node."""
    name = op_name(node)
    if name is None and node.op == "call_method":
        name = node.target
    if name is None and node.op == "call_function":
        name = getattr(node.target, "__name__", None)
    for key in (node.target, name):
        try:
            if key in HALF_OPS:
                return "half"
            if key in FLOAT_OPS:
                return "float"
        except TypeError:  # unhashable target
            continue
    return None


def forced_note(node: Node) -> str:
    for key in (node.target, op_name(node)):
        try:
            if key in FORCED:
                return f" (forced to {FORCED[key]})"
        except TypeError:
            continue
    return ""


# --- fp16 loss scaling -------------------------------------------------------------------------

class DynamicLossScale:
    """The loss scale and its dynamics (GradScaler's defaults): grow after ``interval`` clean
    steps, back off on an overflow and skip that step."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by the scale; True when all are finite."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return True
        torch._foreach_mul_(grads, 1.0 / self.scale)
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def update(self, finite: bool) -> None:
        if finite:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
        else:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by the loss scale on the way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: DynamicLossScale) -> torch.Tensor:
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scaler.scale, None


def scale_outputs(output: Any, scaler: DynamicLossScale) -> Any:
    """Route every floating output that requires grad through the loss scale."""
    if isinstance(output, torch.Tensor):
        return _ScaleGrad.apply(output, scaler) if output.requires_grad and output.is_floating_point() else output
    if isinstance(output, dict):
        for k in list(output.keys()):
            output[k] = scale_outputs(output[k], scaler)
        return output
    if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
        return type(output)(scale_outputs(o, scaler) for o in output)
    return output


def attach_loss_scaling(optimizer: torch.optim.Optimizer, scaler: DynamicLossScale) -> None:
    """Make ``optimizer.step()`` unscale, skip on overflow and update the scale."""
    if getattr(optimizer, "_rewriter_loss_scale", None) is not None:
        return
    inner: Callable[..., Any] = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        finite = scaler.unscale_(self)
        scaler.update(finite)
        if not finite:
            log.info("rewriter: fp16 gradient overflow: step skipped, loss scale now %g", scaler.scale)
            return None
        return inner(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer._rewriter_loss_scale = scaler  # type: ignore[attr-defined]
