"""fuse_rotary_embedding: rotary position embedding into ``torch_npu.npu_rotary_mul`` (NPU only).

Rewrites (LLaMA / GPT-NeoX "half" rotation, ``h = D // 2``)::

    rotate_half(x) = torch.cat((-x[..., h:], x[..., :h]), dim=-1)     # or x.chunk(2, -1)
    x * cos + rotate_half(x) * sin        ->  torch_npu.npu_rotary_mul(x, cos, sin)

(reference npu_ecosystem.md §1.5: rotary_mode 'half'; 3-D or 4-D; D even and < 896; cos/sin
broadcast as 11SD, B1SD or BNSD for a BNSD input). The GPT-J interleaved form is not matched.
CPU/CUDA: stock torch has no fused rotary kernel; an equivalent reordering of the same
element-wise ops would not save memory traffic, so this pass serves the NPU only.
The backend narrows this to what the op documents (``NpuBackend.cannot_rotary``): 4-D, cos/sin
of x's dtype in the 11SD/B1SD/BNSD, 1S1D/BS1D/BSND or S11D/SB1D/SBND layouts, B and N < 1000;
on chips that compile online (Atlas training, 310P) D == 128 only.
Safe when: the halves, negation and cat feed only this rotation, cos and sin have x's last dim.
Contract: exact.
Devices: npu.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import GraphModule, Node

from rewriter.ir import arg, is_op, replace_node, single_user, tensor_info
from rewriter.pass_api import Pass, PassContext, Site, register_pass

_MAX_HEAD_DIM = 896


@dataclass
class RotaryMatch:
    x: Node
    cos: Node
    sin: Node
    out: Node
    dead: list[Node]


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


def _rotate_half_of(cat: object) -> tuple[Node, list[Node]] | None:
    """(x, nodes) when ``cat`` is ``torch.cat((-x2, x1), -1)`` of ``x``'s halves."""
    if not is_op(cat, "cat"):
        return None
    parts, dim = cat.args[0], arg(cat, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not is_op(parts[0], "neg"):
        return None
    neg, x1 = parts
    x2 = neg.args[0]
    x = x1.args[0] if isinstance(x1, Node) and x1.args else None
    info = tensor_info(x)
    if info is None or dim % info.ndim != info.ndim - 1 or info.shape[-1] % 2:
        return None
    half = info.shape[-1] // 2
    if _slice_half(x1, x, True, half) and _slice_half(x2, x, False, half) \
            and single_user(neg, cat) and single_user(x1, cat) and single_user(x2, neg):
        return x, [x1, x2, neg, cat]
    return None


def _cos_sin_fit(x: Node, table: object) -> bool:
    xi, ti = tensor_info(x), tensor_info(table)
    if xi is None or ti is None or ti.ndim != xi.ndim or ti.shape[-1] != xi.shape[-1]:
        return False
    # BNSD input: tables broadcast as 11SD, B1SD or BNSD (§1.5)
    return all(t in (1, s) for t, s in zip(ti.shape, xi.shape)) and ti.shape[-2] == xi.shape[-2]


def match(add: Node) -> RotaryMatch | None:
    if not is_op(add, "add") or len(add.args) != 2:
        return None
    for m_cos, m_sin in (add.args, tuple(reversed(add.args))):
        if not (is_op(m_cos, "mul") and is_op(m_sin, "mul") and single_user(m_cos, add) and single_user(m_sin, add)):
            continue
        for rot, sin in (m_sin.args[:2], tuple(reversed(m_sin.args[:2]))):
            found = _rotate_half_of(rot)
            if found is None:
                continue
            x, nodes = found
            a, b = m_cos.args[:2]
            cos = b if a is x else (a if b is x else None)
            xi = tensor_info(x)
            if cos is None or xi is None or xi.ndim not in (3, 4) or xi.shape[-1] >= _MAX_HEAD_DIM:
                continue
            if _cos_sin_fit(x, cos) and _cos_sin_fit(x, sin):
                return RotaryMatch(x, cos, sin, add, nodes + [m_sin, m_cos])
    return None


class FuseRotaryEmbedding(Pass):
    name = "fuse_rotary_embedding"
    contract = "exact"
    devices = frozenset({"npu"})
    fused_kind = "rotary"

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if not ctx.backend.offers("rotary"):
            return []
        sites = []
        for n in gm.graph.nodes:
            m = match(n)
            if m is None:
                continue
            why = ctx.backend.cannot_rotary(tensor_info(m.x), tensor_info(m.cos), tensor_info(m.sin))
            if why is not None:
                ctx.decline(f"{self.name} at {n.name}", why)
                continue
            sites.append(Site(n, f"{n.name}: rotary on {list(tensor_info(m.x).shape)}", m))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: RotaryMatch = site.match
            with g.inserting_before(m.out):
                new = ctx.backend.emit_rotary(g, m.x, m.cos, m.sin)
            replace_node(m.out, new, self.name, m.dead)


register_pass(FuseRotaryEmbedding())
