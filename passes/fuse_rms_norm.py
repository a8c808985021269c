"""fuse_rms_norm: RMSNorm written out (LLaMA/Qwen style) into one fused norm.

Rewrites (``a`` is the input, often ``x.to(torch.float32)``; ``w`` of shape (D,))::

    a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)          -> F.rms_norm(a, (D,), None, eps)
    w * (that)                    (no cast between, or a no-op one)  -> F.rms_norm(a, (D,), w, eps)
    w * (that).to(half)           (HF: cast before the weight)       -> w * F.rms_norm(a, (D,), None, eps).to(half)
  NPU: torch_npu.npu_rms_norm(a, w, eps)[0] (reference npu_ecosystem.md §1.3).

Safe when: the square, mean, add, rsqrt feed only each other; the mean is over the last dim
with keepdim; ``eps`` is a number; ``w`` is 1-D of the normalised size.
Contract: exact (one reduction instead of several: fp32 rounding only). The NPU form is used
only without a real dtype cast between the norm and the weight (npu_rms_norm computes
internally, so it cannot cast before the weight as HF does; reference §1.3 caveat).
NPU (§1.3): without a weight the stand-in gamma is ``x.new_ones(D)`` (x's device and dtype:
a documented pair on every chip); a weight of another dtype than x is declined (the op returns
x's dtype where PyTorch promotes), as are pairs a chip does not list (bf16 on Atlas
training/310P) and, on 310P, a tail axis under 32 bytes.
Devices: cpu, cuda, npu.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import GraphModule, Node

from rewriter.ir import (
    arg,
    is_cast,
    is_noop_cast,
    is_op,
    replace_node,
    single_user,
    static_number,
    tensor_info,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass


@dataclass
class RmsMatch:
    x: Node
    eps: float
    dim: int
    out: Node               # replaced by the fused node
    weight: Node | None     # folded into the fused call
    dead: list[Node] = field(default_factory=list)


def _squares(sq: object, a: Node) -> bool:
    if is_op(sq, "pow"):
        return sq.args[0] is a and static_number(sq.args[1]) == 2.0
    return is_op(sq, "mul") and sq.args[0] is a and sq.args[1] is a


def _last_dim_mean(mean: Node, ndim: int) -> bool:
    dim = arg(mean, 1, "dim")
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % ndim == ndim - 1 \
        and bool(arg(mean, 2, "keepdim", False))


def match_norm(mul: Node) -> tuple[Node, float, list[Node]] | None:
    """(a, eps, chain) when ``mul`` is ``a * rsqrt(mean(a**2, -1, keepdim) + eps)``."""
    if not is_op(mul, "mul") or len(mul.args) != 2:
        return None
    for a, r in (mul.args, tuple(reversed(mul.args))):
        if not (is_op(r, "rsqrt") and single_user(r, mul) and isinstance(a, Node)):
            continue
        add = r.args[0]
        if not (is_op(add, "add") and single_user(add, r)):
            continue
        mean, eps = add.args[:2]
        if static_number(eps) is None:
            mean, eps = eps, mean
        info = tensor_info(a)
        if static_number(eps) is None or info is None or not is_op(mean, "mean") \
                or not single_user(mean, add) or not _last_dim_mean(mean, info.ndim):
            continue
        sq = mean.args[0]
        if single_user(sq, mean) and _squares(sq, a):
            return a, static_number(eps), [sq, mean, add, r, mul]
    return None


def _weight_of(mul: Node, y: Node, dim: int) -> Node | None:
    if not is_op(mul, "mul") or len(mul.args) != 2:
        return None
    w = mul.args[1] if mul.args[0] is y else mul.args[0]
    info = tensor_info(w)
    return w if info is not None and info.shape == (dim,) else None


def match(norm_mul: Node) -> RmsMatch | None:
    found = match_norm(norm_mul)
    if found is None:
        return None
    a, eps, chain = found
    dim = tensor_info(a).shape[-1]  # type: ignore[union-attr]
    y, cast = norm_mul, None
    if single_user(y) and is_cast(next(iter(y.users))):
        cast = next(iter(y.users))
        y = cast
    if single_user(y) and (w := _weight_of(next(iter(y.users)), y, dim)) is not None:
        wmul = next(iter(y.users))
        if cast is None or is_noop_cast(cast):
            return RmsMatch(a, eps, dim, wmul, w, chain + ([cast] if cast is not None else []))
    return RmsMatch(a, eps, dim, norm_mul, None, chain[:-1])


class FuseRmsNorm(Pass):
    name = "fuse_rms_norm"
    contract = "exact"
    fused_kind = "rms_norm"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if not ctx.backend.offers("rms_norm"):
            return []
        sites = []
        for node in gm.graph.nodes:
            m = match(node)
            if m is None:
                continue
            if ctx.backend.name == "npu" and m.weight is None and m.out is node and _casts_to_weight(node):
                # HF's cast-before-weight: the NPU op cannot reproduce it (§1.3)
                ctx.decline(f"{self.name} at {node.name}", "npu_rms_norm cannot cast between the norm "
                                                           "and the weight as this model does (§1.3)")
                continue
            why = ctx.backend.cannot_rms_norm(tensor_info(m.x), tensor_info(m.weight).dtype
                                              if m.weight is not None else None)
            if why is not None:
                ctx.decline(f"{self.name} at {node.name}", why)
                continue
            sites.append(Site(m.out, f"{node.name}: rms_norm over {m.dim}, eps {m.eps:g}"
                                     f"{', weight folded' if m.weight is not None else ''}", m))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: RmsMatch = site.match
            with g.inserting_before(m.out):
                new = ctx.backend.emit_rms_norm(g, m.x, m.weight, m.eps, m.dim)
            replace_node(m.out, new, self.name, m.dead)


def _casts_to_weight(norm_mul: Node) -> bool:
    return single_user(norm_mul) and is_cast(next(iter(norm_mul.users))) \
        and not is_noop_cast(next(iter(norm_mul.users)))


register_pass(FuseRmsNorm())
