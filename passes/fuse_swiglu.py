"""fuse_swiglu / fuse_geglu: gated activations into torch_npu's fused kernels (NPU only).

Rule tables (``rewriter.rules``; ``c = x.chunk(2, -1)`` or ``x.split(D // 2, -1)``)::

    F.silu(c[0]) * c[1]                           -> torch_npu.npu_swiglu(x, -1)
    F.silu(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu)
                                   -> torch_npu.npu_swiglu(F.linear(x, cat([Wg, Wu]), cat([bg, bu])), -1)
    F.silu(gate) * up   (two tensors)             -> torch_npu.npu_swiglu(torch.cat([gate, up], -1), -1)
    c[0] * F.gelu(c[1])                           -> torch_npu.npu_geglu(x, -1, approximate, False)[0]
    F.gelu(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu)
                                   -> torch_npu.npu_geglu(F.linear(x, cat([Wu, Wg]), cat([bu, bg])), -1, approximate, False)[0]

Which half is activated: npu_swiglu the first (reference npu_ecosystem.md §1.6); npu_geglu with
``activate_left=False`` the second, the one reading all its docs agree on (§1.7: the CANN pages
contradict each other on ``activate_left=True``), the formula the shim records and
``tests/test_rule_reach.py`` pins. So the two-projection GeGLU (Gemma, T5's gated-gelu) is merged
*up* weight first, gate second, and so is the pair ``fuse_qkv_projections`` already merged
(``gelu(split(linear(x, cat([Wg, Wu])))[0]) * [1]``: its cat is rebuilt up first); any other
packed ``gelu(c[0]) * c[1]`` is declined (it would need activate_left=True). Merged weights are concatenated in the graph at every call (as
``fuse_qkv_projections`` does): the model's parameters, their gradients and ``state_dict()``
stay as they are. ``approximate`` follows the model's ``F.gelu`` (0 = erf, 1 = tanh).
CPU/CUDA: stock torch has no fused gated activation: NPU only. Chips (§1.6, §1.7): npu_swiglu
is documented for Atlas A2 only; npu_geglu takes no bf16 on Atlas training/310P.
Safe when: the halves, projections and activation feed only the product; the projections read
one input, weights of one shape and dtype, both with or without bias.
Contract: exact (the same formula in one kernel; the merged GEMM has the same dot products).
Devices: npu.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import Node

from rewriter.capture.ir import hoist_reads, is_parameter_like, tensor_info
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass

HALVES = {"chunk": lambda x, size: x.chunk(2, -1), "split": lambda x, size: x.split(size, -1)}
ACTIVATIONS = {"silu": lambda t, approximate: F.silu(t),
               "gelu": lambda t, approximate: F.gelu(t, approximate=approximate)}


def _packed_pattern(halves, act, activated: int):
    def gated_pattern(x, size, approximate):  # act(c[0]) * c[1], or c[0] * act(c[1])
        c = halves(x, size)
        return act(c[0], approximate) * c[1] if activated == 0 else c[0] * act(c[1], approximate)
    return gated_pattern


def _projections_pattern(act):
    def gated_projections_pattern(x, w_gate, b_gate, w_up, b_up, approximate):
        return act(F.linear(x, w_gate, b_gate), approximate) * F.linear(x, w_up, b_up)
    return gated_projections_pattern


def merged_projections_pattern(x, w_gate, w_up, b, size, approximate):
    # what fuse_qkv_projections makes of gate(x), up(x): one linear on cat([Wg, Wu]), split
    c = F.linear(x, torch.cat([w_gate, w_up], 0), b).split(size, -1)
    return F.gelu(c[0], approximate=approximate) * c[1]


def swiglu_pattern(gate, up):
    return F.silu(gate) * up


def is_halves(m: Match) -> bool:
    info = m.info("x")
    half = info.shape[-1] // 2 if info is not None and info.shape[-1] % 2 == 0 else None
    return half is not None and ("size" not in m.values or m["size"] in (half, [half, half], (half, half)))


def is_two_tensors(m: Match) -> bool:
    a, b = m.info("gate"), m.info("up")
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype


def is_projection_pair(m: Match) -> bool:
    wg, wu = m.info("w_gate"), m.info("w_up")
    return (m.info("x") is not None and wg is not None and wu is not None and wg.ndim == 2
            and wg.shape == wu.shape and wg.dtype == wu.dtype and (m["b_gate"] is None) == (m["b_up"] is None)
            and all(is_parameter_like(m[k]) for k in ("w_gate", "w_up", "b_gate", "b_up")))


def is_merged_pair(m: Match) -> bool:
    b = m["b"]
    halves = b is None or (isinstance(b, Node) and b.target is torch.cat and len(b.args[0]) == 2 and len(b.users) == 1)
    wg, wu = m.info("w_gate"), m.info("w_up")
    return halves and wg is not None and wu is not None and wg.shape == wu.shape and m.info("x") is not None \
        and "size" in m.values and m["size"] in (wg.shape[0], [wg.shape[0]] * 2, (wg.shape[0],) * 2)


def _reordered_merge(g, m: Match):
    """The merged projection rebuilt up-half first (activate_left=False activates the second)."""
    b = m["b"]
    b = g.call_function(torch.cat, ([b.args[0][1], b.args[0][0]], 0)) if b is not None else None
    return g.call_function(F.linear, (m["x"], g.call_function(torch.cat, ([m["w_up"], m["w_gate"]], 0)), b))


def _can_gate(kind: str):
    def can_fuse(m: Match, ctx: PassContext) -> str | None:
        halves = "w_gate" in m.values or "gate" in m.values  # the kernel's input: the two halves
        info = tensor_info(m.root) if halves else m.info("x")
        shape = info.shape[:-1] + (2 * info.shape[-1],) if halves else info.shape
        return ctx.backend.cannot_gated(kind, shape, info.dtype)
    return can_fuse


def _merged_projection(first: str, second: str):
    """``F.linear(x, cat([W_first, W_second]), cat(biases))``: one GEMM, halves in that order."""
    def packed(g, m: Match):
        weights, biases = [m[f"w_{first}"], m[f"w_{second}"]], [m[f"b_{first}"], m[f"b_{second}"]]
        hoist_reads(m.root, weights + biases)
        b = g.call_function(torch.cat, (biases, 0)) if biases[0] is not None else None
        return g.call_function(F.linear, (m["x"], g.call_function(torch.cat, (weights, 0)), b))
    return packed


def _swiglu(packed_of):
    return lambda g, m, ctx: ctx.backend.emit_swiglu(g, packed_of(g, m), -1)


def _geglu(packed_of):
    return lambda g, m, ctx: ctx.backend.emit_geglu(g, packed_of(g, m), -1, m["approximate"])


_packed = lambda g, m: m["x"]  # noqa: E731
_concatenated = lambda g, m: g.call_function(torch.cat, ([m["gate"], m["up"]], -1))  # noqa: E731

SWIGLU, GEGLU = _can_gate("swiglu"), _can_gate("geglu")
SWIGLU_RULES = (
    *(Rule("swiglu (packed)", _packed_pattern(h, ACTIVATIONS["silu"], 0), _swiglu(_packed), (is_halves,), (SWIGLU,))
      for h in HALVES.values()),
    Rule("swiglu (two projections, merged)", _projections_pattern(ACTIVATIONS["silu"]),
         _swiglu(_merged_projection("gate", "up")), (is_projection_pair,), (SWIGLU,)),
    Rule("swiglu (two tensors, concatenated)", swiglu_pattern, _swiglu(_concatenated), (is_two_tensors,), (SWIGLU,)),
)
GEGLU_RULES = (
    *(Rule("geglu (packed)", _packed_pattern(h, ACTIVATIONS["gelu"], 1), _geglu(_packed), (is_halves,), (GEGLU,))
      for h in HALVES.values()),
    # the gate goes second: activate_left=False activates the second half (§1.7)
    Rule("geglu (two projections, merged)", _projections_pattern(ACTIVATIONS["gelu"]),
         _geglu(_merged_projection("up", "gate")), (is_projection_pair,), (GEGLU,)),
    Rule("geglu (merged projections, reordered)", merged_projections_pattern, _geglu(_reordered_merge),
         (is_merged_pair,), (GEGLU,)),
)


class FuseSwiglu(RulePass):
    name = "fuse_swiglu"
    devices = frozenset({"npu"})
    contract = "exact"
    fused_kind = "swiglu"
    version = 2  # two projections merged
    rules = SWIGLU_RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        return ctx.backend.cannot_offer(self.fused_kind)


class FuseGeglu(FuseSwiglu):
    name = "fuse_geglu"
    fused_kind = "geglu"
    rules = GEGLU_RULES


register_pass(FuseSwiglu())
register_pass(FuseGeglu())
