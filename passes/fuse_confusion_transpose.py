"""fuse_confusion_transpose: transpose/permute and reshape/view into one NPU kernel (NPU only).

A rule table (``rewriter.rules``: transpose or permute, reshape or view, either order; the
head split and merge around attention)::

    x.transpose(1, 2)[.contiguous()].reshape(B, S, H)   -> torch_npu.npu_confusion_transpose(x, perm, [B, S, H], True)
    x.view(B, S, N, D).transpose(1, 2)                  -> torch_npu.npu_confusion_transpose(x, perm, [B, S, N, D], False)

(reference npu_ecosystem.md §1.10; the advisor's ``(permute|transpose)-(contiguous){0,1}-(reshape|view)``
patterns, §4.2). The op is marked for planned deprecation in favour of view+permute, which is why
this is gated like every other pass: kept only where it measures faster on the device.
Safe when: the target shape is static (constants in the graph), the intermediate feeds only the
reshape/permute.
Contract: exact (data movement only).
Devices: npu.
"""
from __future__ import annotations

import itertools

from rewriter.capture.ir import tensor_info
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass

REORDERS = {"transpose": lambda x, dims, a, b: x.transpose(a, b), "permute": lambda x, dims, a, b: x.permute(dims)}
RESHAPES = {"reshape": lambda x, shape: x.reshape(shape), "view": lambda x, shape: x.view(shape)}


def _pattern(reorder, reshape, transpose_first: bool):
    def confusion_transpose_pattern(x, dims, a, b, shape):  # a .contiguous() between is an optional link
        if transpose_first:
            return reshape(reorder(x, dims, a, b), shape)
        return reorder(reshape(x, shape), dims, a, b)
    return confusion_transpose_pattern


def _perm(m: Match) -> list[int] | None:
    """The permutation the transpose/permute applies, from its input's rank."""
    reorder = m.node("transpose") or m.node("permute")
    info = tensor_info(reorder.args[0])
    dims = m.values.get("dims", (m.values.get("a"), m.values.get("b")))
    if info is None or not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    if "dims" in m.values:
        return [d % info.ndim for d in dims]
    perm = list(range(info.ndim))
    a, b = (d % info.ndim for d in dims)
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _shape(m: Match) -> list[int] | None:
    """The reshape's target shape, when the graph gives it as constants (a shape computed at
    run time would be wrong baked in for other inputs)."""
    dims = m["shape"]
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    info = tensor_info(m.node("reshape") or m.node("view"))
    if info is None or not all(isinstance(d, int) for d in dims):
        return None
    return list(info.shape)


def is_static(m: Match) -> bool:
    return m.info("x") is not None and _perm(m) is not None and _shape(m) is not None


def can_take(m: Match, ctx: PassContext) -> str | None:
    return ctx.backend.cannot_take("confusion_transpose", m.info("x").dtype)


def _emit(transpose_first: bool):
    return lambda g, m, ctx: ctx.backend.emit_confusion_transpose(g, m["x"], _perm(m), _shape(m), transpose_first)


RULES = tuple(
    Rule("permute then reshape" if first else "reshape then permute", _pattern(REORDERS[r], RESHAPES[s], first),
         _emit(first), (is_static,), (can_take,))
    for first, r, s in itertools.product((True, False), REORDERS, RESHAPES))


class FuseConfusionTranspose(RulePass):
    name = "fuse_confusion_transpose"
    contract = "exact"
    devices = frozenset({"npu"})
    fused_kind = "confusion_transpose"
    rules = RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        return ctx.backend.cannot_offer(self.fused_kind)


register_pass(FuseConfusionTranspose())
