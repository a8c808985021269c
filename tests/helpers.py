"""Apply one pass to a captured model, and compare it with the original."""
from __future__ import annotations

import contextlib
import logging
import random

import numpy as np
import torch

from rewriter.capture.front_ends import Capture, capture
from rewriter.decide.verify import flatten_output
from rewriter.devices.backends import Backend, CpuBackend
from rewriter.pass_api import PassContext, registered_passes


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


def state_snapshot(model, opt=None):
    """Everything measuring could change, copied: tensors, grads, flags, optimizer, RNGs, hooks."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "hooks": [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()],
        # torch.compile marks the module it wraps with ``_is_torch_compile`` (torch's own doing).
        "attributes": [sorted(k for k in vars(m) if k != "_is_torch_compile") for m in model.modules()],
        "opt": None if opt is None else {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
            for i, st in enumerate(opt.state.values())},
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def assert_same_state(a, b):
    """Bit-identical: what ``state_snapshot`` copied, before and after."""
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    for n, g in a["grads"].items():
        assert (g is None) == (b["grads"][n] is None) and (g is None or torch.equal(g, b["grads"][n])), n
    assert a["requires_grad"] == b["requires_grad"] and a["training"] == b["training"]
    assert a["hooks"] == b["hooks"] and a["attributes"] == b["attributes"]
    if a["opt"] is not None:
        assert a["opt"].keys() == b["opt"].keys()
        for i in a["opt"]:
            for k, v in a["opt"][i].items():
                assert torch.equal(v, b["opt"][i][k]) if torch.is_tensor(v) else v == b["opt"][i][k]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]
    assert np.array_equal(a["rng"][2], b["rng"][2])


def assert_trainer_ran_rewritten(callback, model_name: str, plain, rewritten, steps: int) -> None:
    """A trainer integration's callback decided once, kept SDPA and the fused optimizer, every
    step ran the rewritten graphs, and the losses match the plain run step by step."""
    assert callback.error is None and callback.report is not None
    assert callback.report.model == model_name and callback.report.mode == "training"
    assert {"fuse_attention", "fuse_optimizer"} <= set(callback.report.kept_passes)
    assert "scaled_dot_product_attention" in "".join(callback._step.fast.graph_code().values())
    assert callback._step.rewritten_calls == steps
    assert len(rewritten.losses) == len(plain.losses) == steps
    torch.testing.assert_close(torch.stack(rewritten.losses), torch.stack(plain.losses))


@contextlib.contextmanager
def logged_messages(name: str):
    """The INFO (and above) messages logger ``name`` emits inside the block, as a list."""
    logger = logging.getLogger(name)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    messages: list[str] = []
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        messages.extend(r.getMessage() for r in records)


@contextlib.contextmanager
def unhurried():
    """A trainer passes its short run's length (``steps``): deciding then gets at least
    ``MIN_BUDGET`` seconds of wall time, which a loaded CI machine can spend before the passes
    a test expects are reached (their timings come from a controlled clock; the deadline does
    not). Within the body the floor is ten minutes."""
    from rewriter.decide import amortize
    saved = amortize.MIN_BUDGET
    amortize.MIN_BUDGET = 600.0
    try:
        yield
    finally:
        amortize.MIN_BUDGET = saved
