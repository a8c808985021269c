"""fuse_gelu: GELU written out into one activation.

Rewrites::

    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))   -> F.gelu(x, approximate="tanh")
        (transformers' NewGELUActivation / gelu_new; the same formula: exact)
    x * sigmoid(1.702 * x)                                      -> NPU: torch_npu.npu_fast_gelu(x)
        (quick GELU; only with optimize(dtype=...): npu_fast_gelu's formula differs by SoC,
         reference npu_ecosystem.md §1.8, so it is treated as an approximation)
  NPU, tanh form: torch_npu.npu_gelu(x, approximate="tanh") (native F.gelu on NPU ignores
  ``approximate``, §1.8).

Safe when: every intermediate feeds only the next step and the constants match the formula
(to 1e-6 relative).
Contract: exact for the tanh form; the quick-GELU rewrite is an approximation, done only when
the user opted into reduced precision.
Devices: cpu, cuda (tanh form), npu (both).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch.fx import GraphModule, Node

from rewriter.ir import is_op, replace_node, single_user, static_number, tensor_info
from rewriter.pass_api import Pass, PassContext, Site, register_pass

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclass
class GeluMatch:
    x: Node
    out: Node
    kind: str  # "tanh" | "quick"
    dead: list[Node]


def _close(value: float | None, want: float) -> bool:
    return value is not None and abs(value - want) <= 1e-6 * abs(want)


def _scaled(node: object, factor: float) -> object | None:
    """``y`` when ``node`` is ``factor * y`` (either order) with one use, else None."""
    if is_op(node, "mul") and len(node.args) == 2:
        a, b = node.args
        if _close(static_number(a), factor):
            return b
        if _close(static_number(b), factor):
            return a
    if is_op(node, "div") and factor != 0 and _close(static_number(node.args[1]), 1 / factor):
        return node.args[0]
    return None


def _tanh_branch(node: object, x: Node) -> list[Node] | None:
    """Nodes of ``1 + tanh(c * (x + 0.044715 * x**3))``, or None."""
    if not is_op(node, "add") or len(node.args) != 2:
        return None
    one, t = node.args if static_number(node.args[0]) == 1.0 else (node.args[1], node.args[0])
    if static_number(one) != 1.0 or not is_op(t, "tanh") or not single_user(t, node):
        return None
    inner = t.args[0]
    s = _scaled(inner, _SQRT_2_OVER_PI)
    if not is_op(s, "add") or not single_user(inner, t) or not single_user(s, inner):
        return None
    a, b = s.args[:2]
    cube_term = b if a is x else (a if b is x else None)
    cube = _scaled(cube_term, 0.044715)
    if cube is None or not single_user(cube_term, s) or not single_user(cube, cube_term):
        return None
    if not (is_op(cube, "pow") and cube.args[0] is x and static_number(cube.args[1]) == 3.0):
        return None
    return [cube, cube_term, s, inner, t, node]


def match(node: Node) -> GeluMatch | None:
    if not is_op(node, "mul") or len(node.args) != 2:
        return None
    for half_x, rest in (node.args, tuple(reversed(node.args))):
        x = _scaled(half_x, 0.5)
        if isinstance(x, Node) and single_user(half_x, node):
            chain = _tanh_branch(rest, x)
            if chain is not None and single_user(rest, node):
                return GeluMatch(x, node, "tanh", [half_x] + chain)
    for x, sig in (node.args, tuple(reversed(node.args))):
        if is_op(sig, "sigmoid") and single_user(sig, node) and isinstance(x, Node):
            scaled = sig.args[0]
            if _scaled(scaled, 1.702) is x and single_user(scaled, sig):
                return GeluMatch(x, node, "quick", [scaled, sig])
    return None


class FuseGelu(Pass):
    name = "fuse_gelu"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def applies_to(self, ctx: PassContext) -> str | None:
        why = super().applies_to(ctx)
        if why is None:
            tanh = ctx.backend.cannot_offer("gelu_tanh")
            quick = ctx.backend.cannot_offer("quick_gelu") if ctx.dtype is not None else \
                "quick GELU is an approximation, fused only with optimize(dtype=...)"
            if tanh and quick:
                why = f"{tanh}; {quick}"
        return why

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for node in gm.graph.nodes:
            m = match(node)
            if m is None:
                continue
            if m.kind == "quick" and (ctx.dtype is None or not ctx.backend.offers("quick_gelu")):
                continue  # an approximation: only with dtype=, and only where a fused form exists
            kind = "gelu_tanh" if m.kind == "tanh" else "quick_gelu"
            info = tensor_info(m.x)
            why = ctx.backend.cannot_offer(kind) or (
                ctx.backend.cannot_take(kind, info.dtype) if info is not None else None)
            if why is not None:
                ctx.decline(f"{self.name} at {node.name}", why)
                continue
            sites.append(Site(node, f"{node.name}: gelu ({m.kind})", m))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: GeluMatch = site.match
            with g.inserting_before(m.out):
                new = (ctx.backend.emit_gelu_tanh(g, m.x) if m.kind == "tanh"
                       else ctx.backend.emit_quick_gelu(g, m.x))
            replace_node(m.out, new, self.name, m.dead)


register_pass(FuseGelu())
