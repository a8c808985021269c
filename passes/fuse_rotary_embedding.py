"""fuse_rotary_embedding: rotary position embedding into ``torch_npu.npu_rotary_mul`` (NPU only).

A rule table (``rewriter.rules``; LLaMA / GPT-NeoX "half" rotation, ``h = D // 2``)::

    rotate_half(x) = torch.cat((-x[..., h:], x[..., :h]), dim=-1)     # or x.chunk(2, -1)
    x * cos + rotate_half(x) * sin        ->  torch_npu.npu_rotary_mul(x, cos, sin)

(reference npu_ecosystem.md §1.5: rotary_mode 'half'; 3-D or 4-D; D even and < 896; cos/sin
broadcast as 11SD, B1SD or BNSD for a BNSD input). The GPT-J interleaved form is not matched.
CPU/CUDA: stock torch has no fused rotary kernel; an equivalent reordering of the same
element-wise ops would not save memory traffic, so this pass serves the NPU only.
The backend narrows this to what the op documents (``NpuBackend.cannot_rotary``): 4-D, cos/sin
of x's dtype in the 11SD/B1SD/BNSD, 1S1D/BS1D/BSND or S11D/SB1D/SBND layouts, B and N < 1000;
on chips that compile online (Atlas training, 310P) D == 128 only.
Safe when: the negation and cat feed only this rotation (the halves' slices may have other
readers: they stay), cos and sin have x's last dim.
Contract: exact.
Devices: npu.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from rewriter.capture.ir import is_op, tensor_info
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass

_MAX_HEAD_DIM = 896


def rotary_pattern(x, cos, sin, x_lo, x_hi):
    # rotate_half(x) = cat(-x[..., h:], x[..., :h]); the slices are checked by is_rotary
    return x * cos + torch.cat((-x_hi, x_lo), -1) * sin


def rotary_chunk_pattern(x, cos, sin):
    c = x.chunk(2, -1)
    return x * cos + torch.cat((-c[1], c[0]), -1) * sin


def _slice_half(node: object, x: Node, first: bool, half: int) -> bool:
    """``node`` is ``x[..., :half]`` (first) or ``x[..., half:]``."""
    if not (is_op(node, "getitem") and node.args[0] is x):
        return False
    index = node.args[1]
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis:
        s = index[1]
    elif isinstance(index, tuple) and index and all(i == slice(None) for i in index[:-1]):
        s = index[-1]
    else:
        return False
    if not isinstance(s, slice) or s.step not in (None, 1):
        return False
    start, stop = _int_of(s.start), _int_of(s.stop)
    return (start in (None, 0) and stop == half) if first else (start == half and stop is None)


def _int_of(value: object) -> int | None:
    """An int bound, also one the fx trace computes from shapes on the host (``x.shape[-1] // 2``)."""
    if isinstance(value, Node):
        value = value.meta.get("host_scalar")
    return value if isinstance(value, int) else None


def _cos_sin_fit(x: Node, table: object) -> bool:
    xi, ti = tensor_info(x), tensor_info(table)
    if xi is None or ti is None or ti.ndim != xi.ndim or ti.shape[-1] != xi.shape[-1]:
        return False
    # BNSD input: tables broadcast as 11SD, B1SD or BNSD (§1.5)
    return all(t in (1, s) for t, s in zip(ti.shape, xi.shape)) and ti.shape[-2] == xi.shape[-2]


def is_rotary(m: Match) -> bool:
    x, xi = m["x"], m.info("x")
    if xi is None or xi.ndim not in (3, 4) or xi.shape[-1] % 2 or xi.shape[-1] >= _MAX_HEAD_DIM:
        return False
    if "x_lo" in m.values:
        half = xi.shape[-1] // 2
        if not (_slice_half(m["x_lo"], x, True, half) and _slice_half(m["x_hi"], x, False, half)):
            return False
    return _cos_sin_fit(x, m["cos"]) and _cos_sin_fit(x, m["sin"])


def can_fuse(m: Match, ctx: PassContext) -> str | None:
    return ctx.backend.cannot_rotary(m.info("x"), m.info("cos"), m.info("sin"))


def _emit(g, m: Match, ctx: PassContext):
    return ctx.backend.emit_rotary(g, m["x"], m["cos"], m["sin"])


def _describe(m: Match) -> str:
    return f"rotary on {list(m.info('x').shape)}"


RULES = (
    Rule("rotary", rotary_pattern, _emit, (is_rotary,), (can_fuse,), _describe),
    Rule("rotary", rotary_chunk_pattern, _emit, (is_rotary,), (can_fuse,), _describe),
)


class FuseRotaryEmbedding(RulePass):
    name = "fuse_rotary_embedding"
    contract = "exact"
    devices = frozenset({"npu"})
    fused_kind = "rotary"
    version = 2  # the chunked rotate_half too
    rules = RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        return ctx.backend.cannot_offer("rotary")


register_pass(FuseRotaryEmbedding())
