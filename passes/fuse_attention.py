"""fuse_attention: hand-written scaled-dot-product attention into one fused kernel.

Rewrites (q, k, v of shape (..., L, D), (..., S, D), (..., S, Dv))::

    s = q @ k.transpose(-2, -1)         # or torch.matmul / bmm / any (..., D, S) tensor
    s = s * scale  |  s / c             # optional; a number or a static scalar tensor
    s = s + mask                        # optional additive mask, or instead
    s = s.masked_fill(~keep, -inf)      #   a boolean mask (masked_fill or torch.where)
    p = softmax(s, dim=-1)              # optional no-op cast and dropout after it
    out = p @ v
  ->
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=p, scale=scale)
    (npu, training: torch_npu.npu_fusion_attention(q, k, v, N, "BNSD", atten_mask=~keep,
     scale=scale, keep_prob=1-p)[0]; reference npu_ecosystem.md §1.1)

Without a scale op the fused call gets ``scale=1.0`` (SDPA's default would be 1/sqrt(D)).
NPU training form (reference §1.1, op-plugin FlashAttentionKernelNpuOpApi.cpp): every tensor
must be on the NPU, so the causal 2048x2048 mask is made with ``q.new_ones``; ``atten_mask``
takes BNSS, B1SS, 11SS or SS only, so other broadcastable masks (BERT's (B, 1, 1, S)) are
expanded first, as torch_npu's SDPA does, and ``inner_precise=2`` goes with a mask (ditto);
declined, with the reason, off A2/A3/950, for > 256 query heads, key/value of different
shapes, keep_prob outside (0, 1], and additive masks not provably ``where(keep, 0, -big)``
(they would need ``pse``, whose shapes the reference does not document).

Safe when: every intermediate (scores, probabilities) has no other user (attention weights
returned to the caller must stay), the softmax is over the last dim, a boolean fill value is
very negative (≤ -1e4: its exp underflows against ordinary scores), q/k/v share a dtype, and
the mask broadcasts to the scores. Declines two masks at once (bool and additive).
Contract: exact (the fused kernel reorders the softmax reduction: fp32 rounding only). With
dropout the fused kernel draws its own mask: same distribution, different draws.
Devices: cpu, cuda (SDPA), npu (npu_fusion_attention in training, SDPA in inference).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from rewriter.backends import AttentionSpec
from rewriter.ir import (
    CAST_OPS,
    arg,
    is_op,
    op_name,
    replace_node,
    single_user,
    static_number,
    static_tensor,
    tensor_info,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass

_VERY_NEGATIVE = -1e4


@dataclass
class AttentionMatch:
    out: Node
    spec: AttentionSpec
    k_needs_transpose: bool = False   # spec.k holds k^T; emit a transpose
    mask_needs_not: bool = False      # spec.keep_mask holds the fill mask; emit logical_not
    chain: list[Node] = field(default_factory=list)  # nodes that become dead, producer first
    scale_factors: list = field(default_factory=list)  # (number or host-scalar node, divides)


def _scalar(node: Any) -> float | Node | None:
    """A static number, or a node computing a Python number on the host (fx: from shapes)."""
    c = static_number(node)
    if c is not None:
        return c
    if isinstance(node, Node) and isinstance(node.meta.get("host_scalar"), (int, float)):
        return node
    return None


def _broadcasts(mask: Any, scores_shape: tuple[int, ...]) -> bool:
    info = tensor_info(mask)
    if info is None or info.ndim > len(scores_shape):
        return False
    return all(m in (1, s) for m, s in zip(reversed(info.shape), reversed(scores_shape)))


def _match(out: Node) -> tuple[AttentionMatch | None, str]:
    """Walk back from ``p @ v``; returns (match, "") or (None, reason it is not attention)."""
    if not is_op(out, "matmul", "bmm") or len(out.args) != 2:
        return None, ""
    probs, v = out.args
    if not isinstance(probs, Node):
        return None, ""
    chain: list[Node] = []
    dropout_p, node, consumer = 0.0, probs, out
    # peel: dropout and no-op casts after the softmax
    while is_op(node, "dropout", *CAST_OPS):
        if not single_user(node, consumer):
            return None, f"{node.name} has other users"
        if op_name(node) == "dropout":
            if arg(node, 3, "inplace", False):
                return None, "in-place dropout"
            if arg(node, 2, "training", True):
                dropout_p = float(arg(node, 1, "p", 0.5))
        chain.append(node)
        consumer, node = node, node.args[0]
    if not is_op(node, "softmax"):
        return None, ""
    softmax = node
    scores = softmax.args[0]
    s_info = tensor_info(scores)
    if s_info is None:
        return None, "scores have no shape information"
    dim = arg(softmax, 1, "dim")
    if dim is None or dim % s_info.ndim != s_info.ndim - 1:
        return None, "softmax is not over the last dimension"
    if not single_user(softmax, consumer):
        return None, "the attention probabilities have other users"
    chain.append(softmax)
    keep_mask = additive = fill_mask = None
    scale_factors: list[tuple[float | Node, bool]] = []  # (factor, divides)
    node, consumer = scores, softmax
    while True:
        if not isinstance(node, Node) or not single_user(node, consumer):
            return None, f"{getattr(node, 'name', node)} has other users"
        name = op_name(node)
        if name == "add" and additive is None and keep_mask is None and fill_mask is None:
            a, b = node.args[:2]
            cont, mask = (a, b) if _leads_to_qk(a) else (b, a)
            if not _leads_to_qk(cont) or not isinstance(mask, Node):
                return None, "an add that is not a mask"
            additive = mask
        elif name in ("masked_fill", "where") and additive is None and keep_mask is None and fill_mask is None:
            got = _bool_mask(node)
            if got is None:
                return None, "a masked_fill/where whose value is not very negative"
            cont, mask, is_fill = got
            keep_mask, fill_mask = (None, mask) if is_fill else (mask, None)
        elif name == "mul" and (c := _scalar_operand(node)) is not None:
            cont = c[0]
            scale_factors.append((c[1], False))
        elif name == "div" and _scalar(node.args[1]) is not None and _scalar(node.args[1]) != 0:
            cont = node.args[0]
            scale_factors.append((_scalar(node.args[1]), True))
        elif name in ("matmul", "bmm"):
            break
        else:
            return None, ""
        if additive is not None and (keep_mask is not None or fill_mask is not None):
            return None, "both an additive and a boolean mask"
        chain.append(node)
        consumer, node = node, cont
    if additive is not None and _peel_scale_seen_after_mask(chain):
        return None, "a scale applied after the mask"
    qk = node
    q, kt = qk.args
    chain.append(qk)
    q_info, kt_info, v_info = tensor_info(q), tensor_info(kt), tensor_info(v)
    if q_info is None or kt_info is None or v_info is None:
        return None, "q, k or v has no shape information"
    if not (q_info.dtype == kt_info.dtype == v_info.dtype) or not q_info.dtype.is_floating_point:
        return None, f"q, k, v dtypes differ or are not floating ({q_info.dtype}, {kt_info.dtype}, {v_info.dtype})"
    k, k_needs_transpose = _untransposed(kt)
    if not k_needs_transpose:
        chain.append(kt)
    mask = additive if additive is not None else (keep_mask if keep_mask is not None else fill_mask)
    if mask is not None and not _broadcasts(mask, s_info.shape):
        return None, "the mask does not broadcast to the scores"
    if additive is not None and tensor_info(additive).dtype not in (q_info.dtype, torch.bool):
        return None, f"additive mask dtype {tensor_info(additive).dtype} differs from q's {q_info.dtype}"
    k_shape = kt_info.shape[:-2] + (kt_info.shape[-1], kt_info.shape[-2])
    bool_of_additive = _keep_of_additive(additive)
    keep = keep_mask if keep_mask is not None else (
        bool_of_additive if fill_mask is None else _inverted_source(fill_mask))
    causal = s_info.shape[-1] == s_info.shape[-2] and keep is not None and \
        is_causal_keep_mask(keep[1] if isinstance(keep, tuple) else keep)
    spec = AttentionSpec(q=q, k=k, v=v, scale=_fold_scale(scale_factors), dropout_p=dropout_p,
                         keep_mask=keep_mask if keep_mask is not None else fill_mask,
                         additive_mask=additive, bool_of_additive=bool_of_additive,
                         q_shape=q_info.shape, k_shape=k_shape, v_shape=v_info.shape, dtype=q_info.dtype,
                         is_causal=causal, mask_shape=tensor_info(mask).shape if mask is not None else None,
                         k_grouped=_before_repeat_kv(k), v_grouped=_before_repeat_kv(v))
    if spec.k_grouped is None or spec.v_grouped is None:
        spec.k_grouped = spec.v_grouped = None
    return AttentionMatch(out, spec, k_needs_transpose, fill_mask is not None, chain,
                          scale_factors), ""


# --- mask and layout facts -------------------------------------------------------------------

def is_causal_keep_mask(keep: Node) -> bool:
    """True when the boolean keep mask is exactly lower-triangular (key j visible iff j <= i).

    Two spellings are recognised: transformers' ``kv_idx <= q_idx`` built from two aranges (its
    causal mask without padding), and a ``tril`` buffer of ones read with ``get_attr`` (fx) whose
    value is checked, possibly sliced ``[:t, :t]``.
    """
    node = keep
    while is_op(node, "expand") or (is_op(node, "getitem") and _leading_slices(node.args[1])):
        node = node.args[0]
    if is_op(node, "le") or (isinstance(node, Node) and node.target in (operator.le, torch.le)):
        kv, q = node.args[:2]
        return _arange_index(kv, last=True) and _arange_index(q, last=False)
    value = static_tensor(node)
    return value is not None and value.dtype == torch.bool and value.ndim == 2 \
        and torch.equal(value, torch.ones_like(value).tril())


def _leading_slices(index: Any) -> bool:
    """An index of plain ``a:b`` slices from the start (``buf[:t, :t]``, ``mask[:, :, :, :S]``)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) for i in items)


def _arange_index(node: Any, last: bool) -> bool:
    """``arange(n)[None, None, None, :]`` (last) or ``arange(n)[None, None, :, None]``."""
    if not is_op(node, "getitem"):
        return False
    index = node.args[1]
    want = (None, None, None, slice(None)) if last else (None, None, slice(None), None)
    if index != want:
        return False
    src = node.args[0]
    if is_op(src, "add") and static_number(src.args[1]) == 0:
        src = src.args[0]
    return isinstance(src, Node) and src.target is torch.arange and len(src.args) == 1 \
        and isinstance(src.args[0], int) and not src.kwargs.get("dtype")


def _before_repeat_kv(node: Node) -> Node | None:
    """``x`` when ``node`` is transformers' ``repeat_kv(x)``: ``x[:, :, None].expand(...).reshape(...)``."""
    if not is_op(node, "reshape"):
        return None
    expand = node.args[0]
    if not (is_op(expand, "expand") and single_user(expand, node)):
        return None
    unsq = expand.args[0]
    if not (is_op(unsq, "getitem") and unsq.args[1] == (slice(None), slice(None), None, slice(None), slice(None))):
        return None
    src = unsq.args[0]
    info, out = tensor_info(src), tensor_info(node)
    if info is None or out is None or info.ndim != 4 or out.shape[1] % info.shape[1]:
        return None
    return src


def _fold_scale(factors: list[tuple[float | Node, bool]]) -> float | None:
    """The scale as a number, or None while a factor is only known at run time."""
    scale = 1.0
    for f, divides in factors:
        if isinstance(f, Node):
            return None
        scale = scale / f if divides else scale * f
    return scale


def _emit_scale(graph: Any, factors: list[tuple[float | Node, bool]]) -> float | Node:
    """Multiply the scale factors out, in graph nodes where one is a host scalar."""
    scale: float | Node = 1.0
    for f, divides in factors:
        if isinstance(scale, float) and not isinstance(f, Node):
            scale = scale / f if divides else scale * f
        else:
            scale = graph.call_function(operator.truediv if divides else operator.mul, (scale, f))
    return scale


def _leads_to_qk(node: Any) -> bool:
    """True when scale ops lead from ``node`` to a matmul (the scores side of an add)."""
    while isinstance(node, Node):
        if is_op(node, "matmul", "bmm"):
            return True
        if is_op(node, "mul") and _scalar_operand(node) is not None:
            node = _scalar_operand(node)[0]
        elif is_op(node, "div") and _scalar(node.args[1]) is not None:
            node = node.args[0]
        else:
            return False
    return False


def _peel_scale_seen_after_mask(chain: list[Node]) -> bool:
    # chain runs from the softmax backwards; a scale op before the mask op in this list was
    # applied after the mask: softmax((qk + m) * s) is not SDPA's softmax(qk * s + m).
    names = [op_name(n) for n in chain]
    if "add" not in names:
        return False
    return any(n in ("mul", "div") for n in names[:names.index("add")])


def _scalar_operand(node: Node) -> tuple[Any, float | Node] | None:
    a, b = node.args[:2]
    if (c := _scalar(b)) is not None:
        return a, c
    if (c := _scalar(a)) is not None:
        return b, c
    return None


def _bool_mask(node: Node) -> tuple[Any, Node, bool] | None:
    """(continuation, mask, is_fill_mask) for ``masked_fill(x, m, -big)`` / ``where(keep, x, -big)``."""
    if op_name(node) == "masked_fill":
        x, m, value = node.args[0], arg(node, 1, "mask"), arg(node, 2, "value")
        if isinstance(value, (int, float)) and value <= _VERY_NEGATIVE and _is_bool(m):
            return x, m, True
        return None
    cond, a, b = (list(node.args) + [None, None, None])[:3]
    if not _is_bool(cond):
        return None
    if isinstance(b, (int, float)) and b <= _VERY_NEGATIVE and isinstance(a, Node):
        return a, cond, False
    if isinstance(a, (int, float)) and a <= _VERY_NEGATIVE and isinstance(b, Node):
        return b, cond, True
    return None


def _is_bool(node: Any) -> bool:
    info = tensor_info(node)
    return info is not None and info.dtype == torch.bool


def _untransposed(kt: Node) -> tuple[Node, bool]:
    """(k, False) when ``kt`` is a transpose of k's last two dims, else (kt, True)."""
    info = tensor_info(kt)
    if is_op(kt, "transpose") and info is not None:
        dims = {d % info.ndim for d in (arg(kt, 1, "dim0"), arg(kt, 2, "dim1"))}
        if dims == {info.ndim - 2, info.ndim - 1} and len(kt.users) == 1:
            return kt.args[0], False
    return kt, True


def _is_scalar_zeros(node: Any) -> bool:
    return (isinstance(node, Node) and node.op == "call_function" and node.target is torch.zeros
            and len(node.args) == 1 and tuple(node.args[0]) == ())


def _keep_of_additive(mask: Node | None) -> Node | None:
    """``keep`` when ``mask`` is ``where(keep, 0, -big)``, possibly sliced (transformers' masks)."""
    index = None
    node = mask
    if node is not None and node.op == "call_function" and node.target is operator.getitem:
        node, index = node.args
    if not is_op(node, "where") or len(node.args) != 3:
        return None
    cond, zero, neg = node.args
    cond_info, where_info = tensor_info(cond), tensor_info(node)
    if not (static_number(zero) == 0.0 or _is_scalar_zeros(zero)) or not isinstance(neg, (int, float)) or neg > _VERY_NEGATIVE or not _is_bool(cond):
        return None
    if cond_info is None or where_info is None or cond_info.shape != where_info.shape:
        return None
    if index is not None:
        return ("slice", cond, index)  # type: ignore[return-value]  (emitted in apply)
    return cond


def _inverted_source(mask: Node) -> Node | None:
    """``x`` when ``mask`` is written ``~x`` (or ``logical_not``/``bitwise_not`` of it)."""
    if (mask.op == "call_function" and mask.target in (operator.invert, torch.logical_not, torch.bitwise_not)) \
            or (mask.op == "call_method" and mask.target in ("logical_not", "bitwise_not", "__invert__")):
        return mask.args[0]
    return None


def _negated(graph: Any, fill_mask: Node) -> Node:
    """The keep mask for a fill mask: ``x`` itself when the fill mask was written ``~x``."""
    source = _inverted_source(fill_mask)
    return source if source is not None else graph.call_function(torch.logical_not, (fill_mask,))


class FuseAttention(Pass):
    name = "fuse_attention"
    contract = "exact"
    fused_kind = "attention"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for node in gm.graph.nodes:
            match, _ = _match(node)
            if match is None:
                continue
            reason = ctx.backend.cannot_fuse_attention(match.spec, ctx.training)
            if reason is not None:
                ctx.decline(f"{self.name} at {node.name}", reason)
                continue
            s = match.spec
            mask = "causal" if s.is_causal else "additive mask" if s.additive_mask is not None else (
                "boolean mask" if s.keep_mask is not None else "no mask")
            if s.k_grouped is not None:
                mask += ", grouped k/v"
            scale = f"{s.scale:.4g}" if s.scale is not None else "computed at run time"
            sites.append(Site(node, f"{node.name}: q{list(s.q_shape)} k{list(s.k_shape)}, {mask}, "
                                    f"scale {scale}, dropout {s.dropout_p:g}", match))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        graph = gm.graph
        for site in sites:
            m: AttentionMatch = site.match
            spec = m.spec
            with graph.inserting_before(m.out):
                spec = dataclasses.replace(spec, scale=_emit_scale(graph, m.scale_factors))
                if m.k_needs_transpose:
                    spec = dataclasses.replace(spec, k=graph.call_function(torch.transpose, (spec.k, -2, -1)))
                if m.mask_needs_not and not spec.is_causal:
                    spec = dataclasses.replace(spec, keep_mask=_negated(graph, spec.keep_mask))
                if isinstance(spec.bool_of_additive, tuple):
                    _, cond, index = spec.bool_of_additive
                    spec = dataclasses.replace(spec, bool_of_additive=graph.call_function(operator.getitem, (cond, index)))
                new = ctx.backend.emit_attention(graph, spec, ctx.training)
            replace_node(m.out, new, self.name, list(reversed(m.chain)))


register_pass(FuseAttention())
