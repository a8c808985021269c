"""PyTorch Inductor's hand-written attention forms (``_sfdp_pattern_1`` ... ``_30``) as nn.Modules.

Built from torch's own pattern functions in ``torch/_inductor/fx_passes/fuse_attention.py`` with
the example inputs its ``_get_sfdp_patterns()`` gives them, shrunk (fp32)::

    model, args = sfdp_form(5, "float")     # scale as a Python float
    model, args = sfdp_form(1, "tensor")    # scale as a 0-d tensor buffer
    model, args = sfdp_form(1, "input")     # scale as a 0-d tensor input
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import nn
from torch._inductor.fx_passes import fuse_attention as inductor_sfdp

# Example inputs per form, as _get_sfdp_patterns() gives them (they are small already; only
# form 13's (1024, 128, 128) is shrunk): g = q/k/v (2, 4, 8, 16), which the permuting forms read
# as (B, S=4, N=8, D); gp = (2, 8, 4, 16); b = (1, 1, 8, 8) additive mask; m = (2, 1, 1, 4);
# m2d = (2, 4) padding mask (1 = keep); bb = bool (1, 1, 8, 8); mb = bool (2, 1, 1, 4).
# Scale kinds: "c" takes a 0-d tensor in Inductor's table (float, buffer or input here);
# "s" takes a Python float (Inductor's scalar workaround); None takes none.
FORMS: dict[int, tuple[tuple[str, ...], str | None, bool]] = {
    # n: (extra tensor inputs, scale kind, takes dropout_p)
    1: ((), "c", False), 2: ((), "c", False), 3: ((), "c", True), 4: ((), "c", True),
    5: (("b",), "s", False), 6: (("b",), "s", True), 7: ((), "s", True), 8: ((), "s", False),
    9: ((), "s", True), 10: ((), "s", False), 11: ((), "c", False), 12: ((), "c", True),
    13: ((), None, True), 14: (("m",), "c", False), 15: (("m2d",), "c", False),
    16: (("m",), "c", True), 17: (("m2d",), "c", True), 18: (("mb",), "s", True),
    19: (("bb", "bf"), "s", True), 20: (("m2d",), "s", True), 21: (("mf",), None, False),
    22: (("mf",), None, False), 23: ((), None, False), 24: (("bf",), None, False),
    25: (("m",), None, True), 26: (("m",), None, True), 27: ((), None, True),
    28: ((), "c", True), 29: (("b",), "s", False), 30: ((), "s", False),
}
SCALE = 0.66666  # Inductor's inv_scale workaround value; its c() tensor is 2.0


@functools.lru_cache(maxsize=None)
def pattern_function(n: int) -> Callable:
    """``_sfdp_pattern_<n>``, recompiled from torch's own source: Dynamo does not trace into
    ``torch._inductor`` files (it skips them), so the function gets a file name of its own."""
    fn = getattr(inductor_sfdp, f"_sfdp_pattern_{n}")
    namespace = dict(vars(inductor_sfdp))
    exec(compile(inspect.getsource(fn), f"<sfdp_pattern_{n}>", "exec"), namespace)
    if n == 28:  # calls _sfdp_pattern_4 by name: the recompiled one
        exec(compile(inspect.getsource(inductor_sfdp._sfdp_pattern_4), "<sfdp_pattern_4>", "exec"), namespace)
    return namespace[fn.__name__]


def _scale_name(n: int) -> str:
    params = inspect.signature(getattr(inductor_sfdp, f"_sfdp_pattern_{n}")).parameters
    for name in ("inv_scale", "inv_scale_factor", "scale_factor"):
        if name in params:
            return name
    raise KeyError(n)


def _tensor(kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "g":
        return torch.randn(2, 4, 8, 16, generator=gen)
    if kind == "g3d":
        return torch.randn(8, 8, 16, generator=gen)
    if kind == "gp":
        return torch.randn(2, 8, 4, 16, generator=gen)
    if kind in ("b", "bf"):
        return torch.randn(1, 1, 8, 8, generator=gen)
    if kind in ("m", "mf"):
        return torch.randn(2, 1, 1, 4, generator=gen)
    if kind == "m2d":  # a padding mask, 1 = keep (the forms test == 0)
        keep = torch.ones(2, 4)
        keep[0, -2:] = 0
        return keep
    if kind == "bb":
        return torch.tril(torch.ones(1, 1, 8, 8, dtype=torch.bool))
    if kind == "mb":
        keep = torch.ones(2, 1, 1, 4, dtype=torch.bool)
        keep[0, ..., -2:] = False
        return keep
    raise KeyError(kind)


class SfdpForm(nn.Module):
    """Calls ``_sfdp_pattern_<n>`` with the scale given as ``scale_as`` and a fixed dropout."""

    def __init__(self, n: int, scale_as: str | None, dropout_p: float) -> None:
        super().__init__()
        self.n, self.scale_as, self.dropout_p = n, scale_as, dropout_p
        self.fn = pattern_function(n)
        extra, kind, takes_dropout = FORMS[n]
        self.scale_name = _scale_name(n) if kind else None
        self.takes_dropout = takes_dropout
        self.value = 2.0 if kind == "c" else SCALE
        if scale_as == "tensor":
            self.register_buffer("scale", torch.tensor(self.value))

    def forward(self, q, k, v, *rest):
        kw = {}
        if self.takes_dropout:
            kw["dropout_p"] = self.dropout_p
        if self.scale_as == "input":
            *rest, scale = rest
            kw[self.scale_name] = scale
        elif self.scale_as == "tensor":
            kw[self.scale_name] = self.scale
        elif self.scale_as == "float":
            kw[self.scale_name] = self.value
        out = self.fn(q, k, v, *rest, **kw)
        return out[0] if isinstance(out, tuple) else out


def scale_kinds(n: int) -> list[str | None]:
    """The ways the scale can be given to form ``n``: none, or float/tensor/input as it takes."""
    kind = FORMS[n][1]
    return [None] if kind is None else ["float", "tensor", "input"] if kind == "c" else ["float"]


def sfdp_form(n: int, scale_as: str | None = None, dropout_p: float = 0.0) -> tuple[nn.Module, tuple]:
    """Form ``n`` as a module and its (seeded) example inputs."""
    extra, kind, _ = FORMS[n]
    if (kind is None) != (scale_as is None):
        raise ValueError(f"form {n} takes scale kind {kind!r}, not {scale_as!r}")
    gen = torch.Generator().manual_seed(n)
    qkv = "gp" if n in (29, 30) else "g3d" if n == 13 else "g"
    args = [_tensor(qkv, gen) for _ in range(3)] + [_tensor(e, gen) for e in extra]
    model = SfdpForm(n, scale_as, dropout_p)
    if scale_as == "input":
        args.append(torch.tensor(model.value))
    return model, tuple(args)
