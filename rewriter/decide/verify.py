"""Numerics check: a candidate's outputs and gradients against the original model's.

Tolerances are per dtype and scale-aware: an element passes when
``|got - want| <= atol + rtol * |want|`` with ``atol = atol_scale * max(max|want|, 1% of the
largest value among all outputs, or all gradients)``. The first term keeps a tensor of large
values from being held to a bound meant for values near 1; the floor serves tensors that are
analytically zero (the gradient of a key bias under softmax's shift invariance is a sum of
terms that cancel): their rounding noise is set by the size of those terms, not by the
near-zero result. Fused kernels reorder
floating-point reductions (SDPA's online softmax, a fused GEMM epilogue), so even an ``exact``
rewrite differs from the original by a few ulps per reduction step, growing through depth and
backward; the fp32 bounds allow for that and nothing more.

A tensor whose elements exceed the bound still passes when a yardstick shows that much
rounding is inherent: its largest deviation from the original is at most ``factor`` times the
deviation of an equally valid run. fp32: the same model in float64 (the exact result; the
original's own rounding error), computed only when a candidate first exceeds the bound.
bf16/fp16 (``optimize(dtype=...)``): the model under ``torch.autocast``. A gradient that is a
long sum of cancelling terms (a norm weight's, over every token and pixel) rounds at the size of
those terms for any correct form of the computation; a wrong one is off by far more.

Where the original is not finite (a model that already overflows), those elements are not
compared; a non-finite value where the original was finite is a failure.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from rewriter.errors import VerificationError


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol_scale: float


# fp32: a few ulps per reduction step over deep stacks (see module docstring).
# bf16 / fp16: torch.testing.assert_close's per-dtype rtol, as the half-precision floor.
TOLERANCES = {
    torch.float32: Tolerance(rtol=1e-4, atol_scale=1e-5),
    torch.float64: Tolerance(rtol=1e-7, atol_scale=1e-9),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol_scale=1e-2),
    torch.float16: Tolerance(rtol=1e-3, atol_scale=1e-3),
}


@dataclass(frozen=True)
class Yardstick:
    """An equally valid run of the model: how far a correct rewrite may deviate, per tensor."""

    label: str                       # "float64" or "torch.autocast"
    values: dict[str, torch.Tensor]  # the run's outputs and gradients, by name
    factor: float                    # a rewrite may deviate this many times as much


# fp32: as accurate as the original, up to the property tests' factor (tests/test_properties.py).
FLOAT64_FACTOR = 4.0
# bf16/fp16: at most twice as far from fp32 as torch.autocast itself.
AUTOCAST_FACTOR = 2.0


def tolerance_for(dtype: torch.dtype | None) -> Tolerance:
    return TOLERANCES.get(dtype or torch.float32, TOLERANCES[torch.float32])


@dataclass
class Comparison:
    """Result of comparing one run against the reference."""

    ok: bool
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    worst: str = ""  # where the largest violation is, e.g. "grad transformer.h.0.attn.c_attn.weight"
    problem: str = ""
    note: str = ""  # how it passed, where that was not the elementwise bound

    def describe(self) -> str:
        if self.ok:
            return f"max abs error {self.max_abs_error:.2e}" + (f"; {self.note}" if self.note else "")
        return self.problem


class dropout_disabled(TorchFunctionMode):
    """Make dropout the identity for a deterministic numerics check.

    A fused attention kernel draws its dropout mask differently from ``F.dropout`` on the
    probabilities, so with dropout on, a correct rewrite would not match. Both the reference and
    the candidate run with dropout off; that the rewrite carries the dropout probability over
    is checked by construction in the pass and in its tests.
    """

    _DROPOUTS = {F.dropout, torch.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                 F.alpha_dropout, torch.alpha_dropout, F.feature_alpha_dropout}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            kwargs["dropout_p"] = 0.0
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
        return func(*args, **kwargs)


# The functional dropouts, as torch.nn.functional names them.
FUNCTIONAL_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                        "feature_alpha_dropout")


def _identity_dropout(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return input


@contextlib.contextmanager
def dropout_modules_off(modules: Any) -> Iterator[None]:
    """These dropout modules' ``p`` is 0 in the body, and put back after."""
    modules = list(modules)
    saved = [m.p for m in modules]
    for m in modules:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in zip(modules, saved):
            m.p = p


def dropout_modules(module: torch.nn.Module, recurse: bool = True) -> list[torch.nn.Module]:
    """``module``'s dropout modules (all of them, or its direct children)."""
    found = module.modules() if recurse else module.children()
    return [m for m in found if isinstance(m, torch.nn.modules.dropout._DropoutNd)]


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """An eager model's dropout off for a deterministic run: its dropout modules' ``p`` is 0,
    ``torch.nn.functional``'s dropouts are the identity, and :class:`dropout_disabled` takes what
    else reaches torch (``torch.dropout``, SDPA's ``dropout_p``). Not the mode alone: activation
    checkpointing's recompute in backward runs outside it, and a dropout that was the identity in
    forward but drew a mask in the recompute saved tensors the forward had not (its metadata
    check failed: GPT-2, BERT, OPT with their default dropout under gradient checkpointing could
    not be optimized). Only for the eager model's runs: nothing is compiled while they run."""
    with functional_dropout_off(), dropout_modules_off(dropout_modules(model)), dropout_disabled():
        yield


@contextlib.contextmanager
def functional_dropout_off() -> Iterator[None]:
    """``torch.nn.functional``'s dropouts are the identity in the body."""
    functions = {name: getattr(F, name) for name in FUNCTIONAL_DROPOUTS if hasattr(F, name)}
    for name in functions:
        setattr(F, name, _identity_dropout)
    try:
        yield
    finally:
        for name, fn in functions.items():
            setattr(F, name, fn)


def flatten_output(output: Any) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a model output of any pytree shape.

    transformers' ModelOutput and other dataclasses are read field by field.
    """
    found: list[tuple[str, torch.Tensor]] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            found.append((path or "output", obj))
        elif isinstance(obj, dict) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__")):
            for k in obj.keys():
                walk(obj[k], f"{path}.{k}" if path else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
        else:
            leaves, _ = tree_flatten(obj)
            if len(leaves) > 1 or (leaves and leaves[0] is not obj):
                for i, v in enumerate(leaves):
                    walk(v, f"{path}<{i}>")

    walk(output, "")
    return found


def _finite_peak(w: torch.Tensor, peak: float | None = None) -> float:
    """The largest |value| among the finite elements (0.0 when there are none). ``peak``: the
    largest |value| of all elements, when the caller already has it."""
    if peak is None:
        peak = float(w.abs().max())  # one pass; inf or nan when some element is not finite
    if math.isfinite(peak):
        return peak
    finite = torch.isfinite(w)
    return float(torch.where(finite, w.abs(), 0).max()) if bool(finite.any()) else 0.0


def compare_tensors(got: torch.Tensor, want: torch.Tensor, tol: Tolerance, where: str,
                    scale_floor: float = 0.0, peak: float | None = None) -> Comparison:
    """``peak``: the largest |value| of ``want`` when the caller has read it already (inf or nan
    when some element is not finite), so that it is not read twice."""
    if got.shape != want.shape:
        return Comparison(False, math.inf, math.inf, where, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not (want.is_floating_point() or want.is_complex()):
        same = torch.equal(got, want)
        return Comparison(same, 0.0 if same else math.inf, 0.0 if same else math.inf, where,
                          "" if same else f"{where}: integer values differ")
    if not want.numel():
        return Comparison(True, 0.0, 0.0, where)
    # fp32 and wider compare in their own dtype (the difference of two close floats is exact);
    # half dtypes widen to fp32 first.
    wide = torch.promote_types(torch.promote_types(got.dtype, want.dtype), torch.float32)
    g, w = got.detach().to(wide), want.detach().to(wide)
    scale = float(w.abs().max()) if peak is None else peak  # finite when every element of want is
    if not math.isfinite(scale):
        finite = torch.isfinite(w)
        if bool((~torch.isfinite(g) & finite).any()):
            return Comparison(False, math.inf, math.inf, where, f"{where}: non-finite values where the original is finite")
        if not bool(finite.any()):
            return Comparison(True, 0.0, 0.0, where)
        g, w = g[finite], w[finite]
        scale = float(w.abs().max())  # the largest finite |value| of want
    diff = torch.sub(g, w).abs_()
    max_abs = float(diff.max())
    if not math.isfinite(max_abs) and not bool(torch.isfinite(g).all()):
        return Comparison(False, math.inf, math.inf, where, f"{where}: non-finite values where the original is finite")
    atol = tol.atol_scale * max(scale, scale_floor)
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if max_abs <= atol:  # within the absolute bound everywhere: no element can be off
        return Comparison(True, max_abs, max_rel, where)
    bad = diff > w.abs().mul_(tol.rtol).add_(atol)
    if bool(bad.any()):
        return Comparison(False, max_abs, max_rel, where,
                          f"{where}: {int(bad.sum())} of {bad.numel()} elements off "
                          f"(max abs error {max_abs:.3e}, largest value {scale:.3e}, rtol {tol.rtol:g})")
    return Comparison(True, max_abs, max_rel, where)


def compare_runs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                 tol: Tolerance, yardstick: Yardstick | None = None) -> Comparison:
    """Compare named tensors (outputs, then gradients); the worst error is reported.

    ``yardstick``: a tensor beyond the bound passes if it deviates at most ``yardstick.factor``
    times as much as the yardstick's run does (see the module docstring).
    """
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        return Comparison(False, math.inf, math.inf, "",
                          f"different tensors: missing {missing[:5]}, unexpected {extra[:5]}")
    # Each tensor's largest |value| is read once: for its group's floor and for its own bound.
    peaks = {name: float(w.detach().abs().max()) for name, w in want.items()
             if w.is_floating_point() and w.numel()}
    floors: dict[str, float] = {}
    for name, peak in peaks.items():
        group = name.split(" ", 1)[0]
        floors[group] = max(floors.get(group, 0.0), 0.01 * _finite_peak(want[name].detach(), peak))
    worst = Comparison(True)
    judged: list[str] = []  # passed by the yardstick
    for name, w in want.items():
        c = compare_tensors(got[name], w, tol, name, floors.get(name.split(" ", 1)[0], 0.0),
                            peaks.get(name))
        if not c.ok and yardstick is not None and name in yardstick.values:
            c = _within_yardstick(c, got[name], w, yardstick.values[name], yardstick)
        if not c.ok:
            return c
        if c.note:
            judged.append(name)
        if c.max_abs_error >= worst.max_abs_error:
            worst = c
    if judged:
        assert yardstick is not None
        worst = dataclasses.replace(worst, note=(
            f"{len(judged)} tensor(s) beyond the bound ({', '.join(judged[:3])}) are within "
            f"{yardstick.factor:g}x of the {yardstick.label} run's deviation"))
    return worst


def _within_yardstick(failed: Comparison, got: torch.Tensor, want: torch.Tensor,
                      other: torch.Tensor, yardstick: Yardstick) -> Comparison:
    if other.shape != want.shape or not want.is_floating_point():
        return failed
    want_finite = torch.isfinite(want)
    if not bool(torch.isfinite(got[want_finite]).all()):
        return failed  # a new NaN/inf is never rounding
    other = other.to(want.device)  # a float64 yardstick for the NPU ran on the host
    finite = want_finite & torch.isfinite(other)
    if not bool(finite.any()):
        return failed  # the yardstick run overflowed where the original is finite: no measure
    w = want.detach().double()[finite]
    ours = float((got.detach().double()[finite] - w).abs().max())
    theirs = float((other.detach().double()[finite] - w).abs().max())
    if ours <= yardstick.factor * theirs:
        return Comparison(True, ours, failed.max_rel_error, failed.worst, note=yardstick.label)
    return dataclasses.replace(failed, problem=f"{failed.problem}; the {yardstick.label} run "
                               f"deviates {theirs:.3e}, and a rewrite may deviate at most "
                               f"{yardstick.factor:g}x that")


def require_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  tol: Tolerance) -> Comparison:
    c = compare_runs(got, want, tol)
    if not c.ok:
        raise VerificationError(c.problem)
    return c
