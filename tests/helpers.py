"""Apply one pass to a captured model, and compare it with the original."""
from __future__ import annotations

import torch

from rewriter.backends import Backend, CpuBackend
from rewriter.capture import Capture, capture
from rewriter.pass_api import PassContext, registered_passes
from rewriter.verify import flatten_output


def rewrite(model, args, pass_name: str, *, front_end: str = "fx", training: bool = False,
            backend: Backend | None = None, kwargs=None) -> tuple[Capture, list]:
    """Capture ``model``, apply ``pass_name`` to every graph and keep it; return capture, sites."""
    kwargs = kwargs or {}
    cap = capture(model, args, kwargs, front_end)
    if front_end == "dynamo":
        with torch.no_grad() if not training else torch.enable_grad():
            cap(*args, **kwargs)  # Dynamo hands over graphs at the first call
    ctx = PassContext(backend or CpuBackend(), training)
    p = registered_passes()[pass_name]
    sites = []
    for slot in cap.slots:
        sites += slot.try_pass(p, ctx)
        slot.accept()
    return cap, sites


def code(cap: Capture) -> str:
    return "\n".join(cap.graph_code().values())


def outputs_and_grads(fn, args, params, kwargs=None):
    """Outputs of ``fn(*args)`` and, through a fixed cotangent, gradients of ``params``."""
    for p in params:
        p.grad = None
    args = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                 for a in args)
    out = fn(*args, **(kwargs or {}))
    flat = [t for _, t in flatten_output(out)]
    gen = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in flat)
    loss.backward()
    # A parameter the output does not depend on has no gradient: compare it as zeros.
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params] + [a.grad.clone() for a in args
                                                 if isinstance(a, torch.Tensor) and a.grad is not None]
    for p in params:
        p.grad = None
    return [t.detach() for t in flat], grads
