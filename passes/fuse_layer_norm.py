"""fuse_layer_norm: layer norm written out with mean and variance into ``F.layer_norm``.

Rewrites (over the last dim, ``w``/``b`` of shape (D,))::

    u = x.mean(-1, keepdim=True)
    v = (x - u).pow(2).mean(-1, keepdim=True)    # or x.var(-1, keepdim=True, unbiased=False)
    y = (x - u) / torch.sqrt(v + eps)            # or (x - u) * torch.rsqrt(v + eps)
    w * y + b                                    -> F.layer_norm(x, (D,), w, b, eps)

Declines ``(x - u) / (x.std(-1) + eps)``: the unbiased std and eps outside the root are a
different normalisation that ``F.layer_norm`` cannot express.
Safe when: the intermediates feed only each other (``x - u`` may be computed twice), ``eps``
is a number, ``w``/``b`` are 1-D of the normalised size.
Contract: exact (two reductions become one Welford pass: fp32 rounding only).
Devices: cpu, cuda, npu (F.layer_norm everywhere; npu_layer_norm_eval is deprecated, §1.14).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import GraphModule, Node

from rewriter.ir import (
    arg,
    is_op,
    replace_node,
    single_user,
    static_number,
    tensor_info,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass


@dataclass
class LayerNormMatch:
    x: Node
    eps: float
    dim: int
    out: Node
    weight: Node | None
    bias: Node | None
    dead: list[Node]


def _last_dim_keepdim(node: Node, ndim: int) -> bool:
    dim = arg(node, 1, "dim")
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % ndim == ndim - 1 \
        and bool(arg(node, 2 if is_op(node, "mean") else 3, "keepdim", False))


def _centered(node: object) -> tuple[Node, Node] | None:
    """(x, u) when ``node`` is ``x - u`` with ``u = x.mean(-1, keepdim=True)``."""
    if not is_op(node, "sub") or len(node.args) != 2:
        return None
    x, u = node.args
    info = tensor_info(x)
    if is_op(u, "mean") and info is not None and u.args[0] is x and _last_dim_keepdim(u, info.ndim):
        return x, u
    return None


def _variance_of(v: object, x: Node, u: Node) -> list[Node] | None:
    info = tensor_info(x)
    if info is None:
        return None
    if is_op(v, "var") and v.args[0] is x and arg(v, 2, "unbiased", True) is False:
        return [v] if _last_dim_keepdim(v, info.ndim) else None
    if is_op(v, "var") and v.args[0] is x and v.kwargs.get("correction") == 0:
        return [v] if _last_dim_keepdim(v, info.ndim) else None
    if not (is_op(v, "mean") and _last_dim_keepdim(v, info.ndim)):
        return None
    sq = v.args[0]
    if not single_user(sq, v):
        return None
    if is_op(sq, "pow") and static_number(sq.args[1]) == 2.0:
        d = sq.args[0]
    elif is_op(sq, "mul") and sq.args[0] is sq.args[1]:
        d = sq.args[0]
    else:
        return None
    if _centered(d) != (x, u):
        return None
    return [d, sq, v] if single_user(d, sq) else [sq, v]


def _normalized(node: Node) -> tuple[Node, float, list[Node]] | None:
    """(x, eps, chain) when ``node`` is ``(x - u) / sqrt(var + eps)`` or ``* rsqrt(...)``."""
    if is_op(node, "div"):
        d, root, op = node.args[0], node.args[1], "sqrt"
    elif is_op(node, "mul"):
        d, root = node.args[:2]
        if not is_op(root, "rsqrt"):
            d, root = root, d
        op = "rsqrt"
    else:
        return None
    xu = _centered(d)
    if xu is None or not is_op(root, op) or not single_user(root, node):
        return None
    x, u = xu
    add = root.args[0]
    if not (is_op(add, "add") and single_user(add, root)):
        return None
    v, eps = add.args[:2]
    if static_number(eps) is None:
        v, eps = eps, v
    var_chain = _variance_of(v, x, u) if static_number(eps) is not None and single_user(v, add) else None
    if var_chain is None:
        return None
    if any(user not in (node, *var_chain) for user in d.users) or \
            any(user not in (d, *var_chain) and not _centered(user) for user in u.users):
        return None
    return x, static_number(eps), [u, *var_chain, d, add, root, node]


def _affine(y: Node, dim: int) -> tuple[Node, Node | None, Node | None, list[Node]]:
    """(out, w, b, inner): ``w * y + b`` around ``y`` where present; ``inner`` are the nodes
    between ``y`` and ``out``."""
    out, w, b, inner = y, None, None, []
    for op in ("mul", "add"):
        if not (single_user(out) and is_op(user := next(iter(out.users)), op) and len(user.args) == 2):
            continue
        cand = user.args[1] if user.args[0] is out else user.args[0]
        if (info := tensor_info(cand)) is None or info.shape != (dim,):
            continue
        inner.append(out)
        out = user
        w, b = (cand, b) if op == "mul" else (w, cand)
    return out, w, b, inner


def match(node: Node) -> LayerNormMatch | None:
    found = _normalized(node)
    if found is None:
        return None
    x, eps, chain = found
    dim = tensor_info(x).shape[-1]  # type: ignore[union-attr]
    out, w, b, inner = _affine(node, dim)
    dead = [n for n in dict.fromkeys(chain + inner) if n is not out]
    return LayerNormMatch(x, eps, dim, out, w, b, dead)


class FuseLayerNorm(Pass):
    name = "fuse_layer_norm"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if not ctx.backend.offers("layer_norm"):
            return []
        return [Site(m.out, f"{n.name}: layer_norm over {m.dim}, eps {m.eps:g}", m)
                for n in gm.graph.nodes if (m := match(n)) is not None]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: LayerNormMatch = site.match
            with g.inserting_before(m.out):
                new = ctx.backend.emit_layer_norm(g, m.x, m.weight, m.bias, m.eps, m.dim)
            replace_node(m.out, new, self.name, m.dead)


register_pass(FuseLayerNorm())
