"""fuse_swiglu / fuse_geglu: gated activations into torch_npu's fused kernels (NPU only).

Rule tables (``rewriter.rules``)::

    c = x.chunk(2, -1);  F.silu(c[0]) * c[1]     -> torch_npu.npu_swiglu(x, -1)        (or x.split)
    F.silu(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu)
                                                 -> torch_npu.npu_swiglu(F.linear(x, cat([Wg, Wu]), cat([bg, bu])), -1)
    F.silu(gate) * up   (two tensors)            -> torch_npu.npu_swiglu(torch.cat([gate, up], -1), -1)
    c = x.chunk(2, -1);  c[0] * F.gelu(c[1])     -> torch_npu.npu_geglu(x, -1, approximate, False)[0]
    F.gelu(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu)
                                                 -> torch_npu.npu_geglu(F.linear(x, cat([Wu, Wg]), cat([bu, bg])), -1, approximate, False)[0]

Which half is activated: npu_swiglu activates the first half (reference npu_ecosystem.md §1.6).
npu_geglu with ``activate_left=False`` activates the second half, the reading every version of
its docs agrees on (§1.7: the CANN pages contradict each other on ``activate_left=True``), and
that is the formula the shim records and ``tests/test_fused_ops.py`` pins. So the two-projection
GeGLU (Gemma, T5's gated-gelu: ``gelu(gate(x)) * up(x)``) is merged with the *up* weight first
and the gate second; a packed ``gelu(c[0]) * c[1]`` is declined (it would need activate_left=True).
The merged weights are concatenated in the graph at every call (as ``fuse_qkv_projections``
does): the model keeps its own parameters, gradients reach each of them, ``state_dict()`` is
unchanged. ``approximate`` follows the model's ``F.gelu`` (0 = erf, 1 = tanh).
CPU/CUDA: stock torch has no fused gated activation, so these passes serve the NPU only.
Chips (reference §1.6, §1.7): npu_swiglu is documented for Atlas A2 only; npu_geglu takes no
bf16 on Atlas training/310P; the pass says so where it does not apply.
Safe when: the halves, projections and the activation feed only the product; the two
projections read one input, with weights of one shape and dtype, both with or without bias.
Contract: exact (the same formula in one kernel; the merged GEMM has the same dot products).
Devices: npu.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rewriter.ir import hoist_reads, is_parameter_like, tensor_info
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass


def swiglu_chunk_pattern(x):
    c = x.chunk(2, -1)
    return F.silu(c[0]) * c[1]


def swiglu_split_pattern(x, size):
    c = x.split(size, -1)
    return F.silu(c[0]) * c[1]


def swiglu_projections_pattern(x, w_gate, b_gate, w_up, b_up):
    return F.silu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)


def swiglu_pattern(gate, up):
    return F.silu(gate) * up


def geglu_chunk_pattern(x, approximate):
    c = x.chunk(2, -1)
    return c[0] * F.gelu(c[1], approximate=approximate)


def geglu_split_pattern(x, size, approximate):
    c = x.split(size, -1)
    return c[0] * F.gelu(c[1], approximate=approximate)


def geglu_projections_pattern(x, w_gate, b_gate, w_up, b_up, approximate):
    return F.gelu(F.linear(x, w_gate, b_gate), approximate=approximate) * F.linear(x, w_up, b_up)


# --- structural conditions -----------------------------------------------------------------

def is_halves(m: Match) -> bool:
    info = m.info("x")
    if info is None or info.shape[-1] % 2:
        return False
    half = info.shape[-1] // 2
    return "size" not in m.values or m["size"] in (half, [half, half], (half, half))


def is_two_tensors(m: Match) -> bool:
    a, b = m.info("gate"), m.info("up")
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype


def is_projection_pair(m: Match) -> bool:
    wg, wu = m.info("w_gate"), m.info("w_up")
    biases = (m["b_gate"] is None) == (m["b_up"] is None)
    params = all(is_parameter_like(m[k]) for k in ("w_gate", "w_up", "b_gate", "b_up"))
    return (m.info("x") is not None and wg is not None and wu is not None and wg.ndim == 2
            and wg.shape == wu.shape and wg.dtype == wu.dtype and biases and params)


def _packed_shape(m: Match) -> tuple[tuple[int, ...], torch.dtype] | None:
    if "gate" in m.values:  # two tensors, concatenated on the last dim
        info = m.info("gate")
        return info.shape[:-1] + (2 * info.shape[-1],), info.dtype
    if "w_gate" in m.values:
        info = tensor_info(m.root)
        return info.shape[:-1] + (2 * info.shape[-1],), info.dtype
    info = m.info("x")
    return info.shape, info.dtype


def _can_gate(kind: str):
    def can_fuse(m: Match, ctx: PassContext) -> str | None:
        shape, dtype = _packed_shape(m)
        return ctx.backend.cannot_gated(kind, shape, dtype)
    can_fuse.__name__ = f"can_fuse_{kind}"
    return can_fuse


# --- replacements --------------------------------------------------------------------------

def _merged_projection(g, m: Match, first: str, second: str):
    """``F.linear(x, cat([W_first, W_second]), cat(biases))``: one GEMM, halves in that order."""
    weights = [m[f"w_{first}"], m[f"w_{second}"]]
    biases = [m[f"b_{first}"], m[f"b_{second}"]]
    hoist_reads(m.root, weights + biases)
    w = g.call_function(torch.cat, (weights, 0))
    b = g.call_function(torch.cat, (biases, 0)) if biases[0] is not None else None
    return g.call_function(F.linear, (m["x"], w, b))


def _swiglu(packed_of):
    return lambda g, m, ctx: ctx.backend.emit_swiglu(g, packed_of(g, m), -1)


def _geglu(packed_of):
    return lambda g, m, ctx: ctx.backend.emit_geglu(g, packed_of(g, m), -1, m["approximate"])


def _packed(g, m):
    return m["x"]


def _concatenated(g, m):
    return g.call_function(torch.cat, ([m["gate"], m["up"]], -1))


SWIGLU = _can_gate("swiglu")
GEGLU = _can_gate("geglu")
SWIGLU_RULES = (
    Rule("swiglu (packed)", swiglu_chunk_pattern, _swiglu(_packed), (is_halves,), (SWIGLU,)),
    Rule("swiglu (packed)", swiglu_split_pattern, _swiglu(_packed), (is_halves,), (SWIGLU,)),
    Rule("swiglu (two projections, merged)", swiglu_projections_pattern,
         _swiglu(lambda g, m: _merged_projection(g, m, "gate", "up")), (is_projection_pair,), (SWIGLU,)),
    Rule("swiglu (two tensors, concatenated)", swiglu_pattern, _swiglu(_concatenated),
         (is_two_tensors,), (SWIGLU,)),
)
GEGLU_RULES = (
    Rule("geglu (packed)", geglu_chunk_pattern, _geglu(_packed), (is_halves,), (GEGLU,)),
    Rule("geglu (packed)", geglu_split_pattern, _geglu(_packed), (is_halves,), (GEGLU,)),
    # the gate goes second: activate_left=False activates the second half (§1.7)
    Rule("geglu (two projections, merged)", geglu_projections_pattern,
         _geglu(lambda g, m: _merged_projection(g, m, "up", "gate")), (is_projection_pair,), (GEGLU,)),
)


class FuseSwiglu(RulePass):
    name = "fuse_swiglu"
    devices = frozenset({"npu"})
    contract = "exact"
    fused_kind = "swiglu"
    version = 2  # two projections merged
    rules = SWIGLU_RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        return ctx.backend.cannot_offer("swiglu")


class FuseGeglu(FuseSwiglu):
    name = "fuse_geglu"
    fused_kind = "geglu"
    rules = GEGLU_RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        return ctx.backend.cannot_offer("geglu")


register_pass(FuseSwiglu())
register_pass(FuseGeglu())
