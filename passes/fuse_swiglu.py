"""fuse_swiglu / fuse_geglu: gated activations into torch_npu's fused kernels (NPU only).

Rewrites::

    a, b = x.chunk(2, -1);  F.silu(a) * b      -> torch_npu.npu_swiglu(x, -1)
    F.silu(gate) * up   (two tensors)          -> torch_npu.npu_swiglu(torch.cat([gate, up], -1), -1)
    a, b = x.chunk(2, -1);  a * F.gelu(b)      -> torch_npu.npu_geglu(x, -1, approximate, False)[0]

npu_swiglu activates the first half (reference npu_ecosystem.md §1.6). npu_geglu with
``activate_left=False`` activates the second half, the reading every version of its docs agrees
on (§1.7); ``gelu(a) * b`` (first half) is declined: the docs contradict each other on what
``activate_left=True`` means. ``approximate`` follows the model's ``F.gelu`` (0 = erf, 1 = tanh).
CPU/CUDA: stock torch has no fused gated activation, so these passes serve the NPU only (with
separate gate/up projections, ``fuse_qkv_projections`` already merges the two GEMMs there).
Chips (reference §1.6, §1.7): npu_swiglu is documented for Atlas A2 only; npu_geglu takes no
bf16 on Atlas training/310P; the pass says so where it does not apply.
Safe when: the halves and the activation feed only the product.
Contract: exact (the same formula in one kernel).
Devices: npu.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from rewriter.ir import arg, is_op, op_name, replace_node, single_user, tensor_info
from rewriter.pass_api import Pass, PassContext, Site, register_pass


@dataclass
class GatedMatch:
    out: Node
    packed: Node | None          # the tensor whose halves are gate and up
    halves: tuple[Node, Node]    # (activated, other) when not packed
    approximate: str
    dead: list[Node]


def _halves_of(a: object, b: object) -> Node | None:
    """``x`` when ``a``/``b`` are the first/second half of ``x`` along its last dim."""
    if not (is_op(a, "getitem") and is_op(b, "getitem") and a.args[0] is b.args[0]):
        return None
    if (a.args[1], b.args[1]) != (0, 1):
        return None
    parts = a.args[0]
    src = parts.args[0] if isinstance(parts, Node) and parts.args else None
    info = tensor_info(src)
    if info is None or not single_user(a) or not single_user(b) or len(parts.users) != 2:
        return None
    last = info.ndim - 1
    if op_name(parts) == "chunk" and arg(parts, 1, "chunks") == 2 and arg(parts, 2, "dim", 0) % info.ndim == last:
        return src
    if op_name(parts) == "split" and arg(parts, 1, "split_size_or_sections") in (info.shape[-1] // 2, [info.shape[-1] // 2] * 2) \
            and arg(parts, 2, "dim", 0) % info.ndim == last:
        return src
    return None


def match_gated(node: Node, activation: str, activated_first: bool) -> GatedMatch | None:
    if not is_op(node, "mul") or len(node.args) != 2:
        return None
    for act, other in (node.args, tuple(reversed(node.args))):
        if not (is_op(act, activation) and single_user(act, node) and isinstance(other, Node)):
            continue
        inner = act.args[0]
        approximate = act.kwargs.get("approximate", "none") if activation == "gelu" else ""
        first, second = (inner, other) if activated_first else (other, inner)
        packed = _halves_of(first, second)
        if packed is not None:
            return GatedMatch(node, packed, (inner, other), approximate, [act, first, second, first.args[0]])
        a, b = tensor_info(inner), tensor_info(other)
        if a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype:
            return GatedMatch(node, None, (inner, other), approximate, [act])
    return None


class _GatedPass(Pass):
    devices = frozenset({"npu"})
    contract = "exact"
    activation = ""
    kind = ""
    activated_first = True

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if not ctx.backend.offers(self.kind):
            return []
        sites = []
        for node in gm.graph.nodes:
            m = match_gated(node, self.activation, self.activated_first)
            if m is None or (self.kind == "geglu" and m.packed is None):
                continue
            if m.packed is not None:
                info = tensor_info(m.packed)
                shape, dtype = (info.shape, info.dtype) if info is not None else ((), None)
            else:  # the two halves are concatenated on the last dim
                info = tensor_info(m.halves[0])
                shape, dtype = info.shape[:-1] + (2 * info.shape[-1],), info.dtype
            why = ctx.backend.cannot_gated(self.kind, shape, dtype) if dtype is not None else \
                "the packed input has no shape information"
            if why is not None:
                ctx.decline(f"{self.name} at {node.name}", why)
                continue
            form = "packed" if m.packed is not None else "two tensors, concatenated"
            sites.append(Site(node, f"{node.name}: {self.kind} ({form})", m))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: GatedMatch = site.match
            with g.inserting_before(m.out):
                packed = m.packed if m.packed is not None else \
                    g.call_function(torch.cat, ([m.halves[0], m.halves[1]], -1))
                new = self.emit(g, ctx, packed, m)
            replace_node(m.out, new, self.name, list(reversed(m.dead)))

    def emit(self, g, ctx: PassContext, packed: Node, m: GatedMatch) -> Node:
        raise NotImplementedError


class FuseSwiglu(_GatedPass):
    name = "fuse_swiglu"
    activation = "silu"
    kind = "swiglu"
    fused_kind = "swiglu"

    def emit(self, g, ctx, packed, m):
        return ctx.backend.emit_swiglu(g, packed, -1)


class FuseGeglu(_GatedPass):
    name = "fuse_geglu"
    activation = "gelu"
    kind = "geglu"
    fused_kind = "geglu"
    activated_first = False  # a * gelu(b): the second half is activated

    def emit(self, g, ctx, packed, m):
        return ctx.backend.emit_geglu(g, packed, -1, m.approximate)


register_pass(FuseSwiglu())
register_pass(FuseGeglu())
