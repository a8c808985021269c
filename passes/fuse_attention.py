"""fuse_attention: hand-written scaled-dot-product attention into one fused kernel.

Rewrites (q, k, v of shape (..., L, D), (..., S, D), (..., S, Dv))::

    s = q @ k.transpose(-2, -1)         # or torch.matmul / bmm / aten; k^T as permute(0, 1, 3, 2)
    s = s * scale  |  s / c  |  s /= c  # optional; a number, a host scalar or a 0-d tensor
    s = s + mask                        # optional masks, any number, in any order:
    s = s.masked_fill(~keep, -inf)      #   additive, or boolean with a very negative fill
    p = softmax(s, dim=-1)              # or aten._safe_softmax; casts, clone, dropout after it
    out = p @ v
  ->
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=p, scale=scale)
    (npu, training: torch_npu.npu_fusion_attention(q, k, v, N, "BNSD", atten_mask=~keep,
     scale=scale, keep_prob=1-p)[0]; reference npu_ecosystem.md §1.1)

The matcher walks back from ``p @ v`` in four named steps (``_probabilities``,
``_softmax_input``, ``_scores``, ``_qkv``), then ``_spec`` checks dtypes and masks. It reads
the spellings model code writes (Inductor's 30 ``_sfdp_pattern_*`` forms and ten transformers
families, ``tests/test_reach_attention.py``):

* scale: numbers, host scalars (from shapes) and 0-d constants (``torch.full([], c)``) fold into
  ``scale``; a 0-d tensor computed at run time (an input, a buffer) multiplies q instead, so its
  gradient flows as before. Without a scale op the fused call gets ``scale=1.0`` (SDPA's default
  would be 1/sqrt(D)).
* masks: one boolean fill (``masked_fill``/``where``, the fill a number or a 0-d constant such
  as ``torch.full((), -inf)``) is a keep mask; one additive float mask goes in as is; anything
  else (position bias + padding mask, a fill and an add, an added **bool**, which adds 0/1 and is
  never a keep mask) becomes one additive mask, folded in graph order (``+ m``, and
  ``where(keep, total, fill)`` for a fill: s + fill rounds to fill, or underflows in exp like
  the original). A mask built with ``mask.expand_as(scores)`` is re-pointed to ``expand(shape)``.
* dtypes: the rewrite computes in the dtype the original computed in, or declines: between
  q @ k^T and p @ v values stay in q's dtype, or are upcast to float32 for the softmax and come
  back to q's dtype before p @ v (SDPA's and npu_fusion_attention's kernels compute the softmax
  of half inputs in float32); other casts decline with the dtype.
* layouts: (B*N, L, S) scores viewed to (B, N, L, S) and back (before or after the softmax:
  Inductor's form 24, BLOOM) give the fused op (B, N, ...) q/k/v and the result is reshaped back;
  ``bias.baddbmm(q, k^T, beta=1, alpha=a)`` (BLOOM's ALiBi) is scale ``a`` and an additive term;
  one-head multi-query k/v (Falcon) is expanded for SDPA and passed as is to the NPU kernel
  (Nq % Nkv == 0, §1.1), like transformers' ``repeat_kv``'d k/v.
* dropout: in training its p goes into the fused call (the kernel draws its own mask: same
  distribution, different draws); in eval, or ``training=False``, p is 0.

NPU training form (reference §1.1, op-plugin FlashAttentionKernelNpuOpApi.cpp): every tensor
must be on the NPU, so the causal 2048x2048 mask is made with ``q.new_ones``; ``atten_mask``
takes BNSS, B1SS, 11SS or SS only, so other broadcastable masks (BERT's (B, 1, 1, S)) are
expanded first, as torch_npu's SDPA does, and ``inner_precise=2`` goes with a mask (ditto);
declined, with the reason, off A2/A3/950, for > 256 query heads, key/value of different
shapes, keep_prob outside (0, 1], and additive masks not provably ``where(keep, 0, -big)``
(ALiBi, T5's position bias: they would need ``pse``, whose shapes the reference does not
document).

Safe when: every intermediate (scores, probabilities) has no other user but shape reads
(attention weights returned to the caller must stay), the softmax is over the last dim, a
boolean fill value is very negative (<= -1e4: its exp underflows against ordinary scores), no
scale follows a mask, q/k/v share a dtype, and every mask broadcasts to the scores. A matched
form that cannot be fused is declined through ``ctx.decline`` with the reason.
Contract: exact (the fused kernel reorders the softmax reduction: fp32 rounding only).
Devices: cpu, cuda (SDPA), npu (npu_fusion_attention in training, SDPA in inference, a decode
step's as npu_fused_infer_attention_score: rewriter.devices.npu_decode_attention).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from rewriter.capture.ir import (
    CAST_OPS,
    arg,
    erase_if_unused,
    is_op,
    mark_new_node,
    op_name,
    replace_node,
    single_user,
    static_number,
    static_tensor,
    tensor_info,
)
from rewriter.devices.backends import AttentionSpec
from rewriter.pass_api import Pass, PassContext, Site, register_pass

_VERY_NEGATIVE = -1e4


# --- the vocabulary: one op however it is spelled ------------------------------------------

# aten overloads (``torch.ops.aten.mul.Scalar``, ``aten._safe_softmax``) and in-place operators
# (``scores /= c`` is ``operator.itruediv``: safe here, the walk only crosses single-user nodes).
_ATEN_NAMES = {"aten::mul": "mul", "aten::div": "div", "aten::add": "add", "aten::matmul": "matmul",
               "aten::bmm": "bmm", "aten::softmax": "softmax", "aten::_safe_softmax": "_safe_softmax",
               "aten::transpose": "transpose", "aten::permute": "permute", "aten::clone": "clone",
               "aten::view": "view", "aten::reshape": "reshape", "aten::masked_fill": "masked_fill",
               "aten::where": "where"}
_INPLACE_NAMES = {operator.itruediv: "div", operator.imul: "mul", operator.iadd: "add"}
_FUNCTION_NAMES = {torch.baddbmm: "baddbmm", torch.clone: "clone", torch.softmax: "softmax"}
_SOFTMAX = ("softmax", "_safe_softmax")  # _safe_softmax: 0 for all -inf rows, as SDPA gives
_CASTS = (*CAST_OPS, "half", "bfloat16", "double")  # checked by _check_dtypes
_AFTER_SOFTMAX = ("dropout", "clone", "contiguous", *_CASTS)  # peeled between softmax and p @ v
_VIEWS = ("view", "reshape")


def _op(node: Any) -> str | None:
    """``op_name`` plus the aten and in-place spellings this pass reads."""
    if not isinstance(node, Node):
        return None
    name = op_name(node)
    if name is not None or node.op != "call_function":
        return name
    target = node.target
    try:
        if target in _INPLACE_NAMES:
            return _INPLACE_NAMES[target]
        if target in _FUNCTION_NAMES:
            return _FUNCTION_NAMES[target]
    except TypeError:  # unhashable target
        return None
    schema = getattr(target, "_schema", None)
    qualified = schema.name if schema is not None else getattr(target, "_qualified_op_name", None)
    return _ATEN_NAMES.get(qualified)


def _is(node: Any, *names: str) -> bool:
    return _op(node) in names


# --- what a match holds ----------------------------------------------------------------------

@dataclass
class Term:
    """One mask applied to the scores, in graph order: an additive tensor (``kind="add"``), or a
    boolean mask with a very negative fill (``kind="fill"``: ``fill_mask`` True where filled)."""

    kind: str
    mask: Node
    value: float = 0.0          # the fill value (kind "fill")
    fill_mask: bool = False     # mask is True where filled (masked_fill) rather than kept
    before_split: bool = False  # applied to the (B*N, L, S) scores outside a split/merge view pair


@dataclass
class AttentionMatch:
    out: Node
    spec: AttentionSpec
    k_needs_transpose: bool = False   # spec.k holds k^T; emit a transpose
    chain: list[Node] = field(default_factory=list)  # nodes that become dead
    scale_factors: list = field(default_factory=list)  # (number or host-scalar node, divides)
    q_factors: list = field(default_factory=list)      # (0-d tensor node, divides): applied to q
    terms: list[Term] = field(default_factory=list)
    shape_users: list[Node] = field(default_factory=list)  # mask.expand_as(scores) to re-point
    split: tuple[int, int] | None = None  # (B, N) when the scores were viewed (B*N, L, S) -> 4-D
    k_expand: tuple[int, ...] | None = None  # broadcast k/v (one-head multi-query) to this shape
    v_expand: tuple[int, ...] | None = None


class _NoMatch(Exception):
    """Not attention, or attention that cannot be fused: ``reason`` ("" when not attention)."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


def _scalar(node: Any) -> float | Node | None:
    """A static number, or a node computing a Python number on the host (fx: from shapes)."""
    c = static_number(node)
    if c is not None:
        return c
    if isinstance(node, Node) and isinstance(node.meta.get("host_scalar"), (int, float)):
        return node
    return None


def _tensor_scalar(node: Any) -> Node | None:
    """A 0-d floating tensor computed at run time (a scale given as a tensor input or buffer)."""
    info = tensor_info(node)
    if info is not None and info.ndim == 0 and info.dtype.is_floating_point:
        return node
    return None


def _scale_operand(node: Node) -> tuple[Any, float | Node, bool] | None:
    """(scores side, factor, is a 0-d tensor) for ``x * c``, ``c * x``, ``x / c``, else None."""
    a, b = (list(node.args) + [None, None])[:2]
    if _is(node, "div"):
        c = _scalar(b)
        if c is not None and c != 0:
            return a, c, False
        return (a, b, True) if _tensor_scalar(b) is not None else None
    if not _is(node, "mul"):
        return None
    for x, c in ((a, b), (b, a)):
        if _scalar(c) is not None:
            return x, _scalar(c), False
    for x, c in ((a, b), (b, a)):
        if _tensor_scalar(c) is not None and tensor_info(x) is not None and tensor_info(x).ndim > 0:
            return x, c, True
    return None


def _shape_reads(node: Node, consumer: Node) -> list[Node] | None:
    """The users of ``node`` besides ``consumer`` when all only read its shape
    (``mask.expand_as(scores)``), else None."""
    others = [u for u in node.users if u is not consumer]
    if all(_is(u, "expand_as") and len(u.args) == 2 and u.args[1] is node and u.args[0] is not node
           for u in others):
        return others
    return None


# --- the matcher: four named steps, walking back from p @ v ------------------------------------

def _match(out: Node) -> tuple[AttentionMatch | None, str]:
    """Walk back from ``p @ v``; returns (match, "") or (None, reason it is not fused; "" when
    it is not attention at all)."""
    if not _is(out, "matmul", "bmm") or len(out.args) != 2 or not isinstance(out.args[0], Node):
        return None, ""
    try:
        m = AttentionMatch(out, None)  # type: ignore[arg-type]
        softmax, dropout_p, merge = _probabilities(m, out)
        scores = _softmax_input(softmax)
        qk = _scores(m, scores, softmax, merge)
        q, k, v = _qkv(m, qk, out.args[1])
        m.spec = _spec(m, q, k, v, dropout_p)
    except _NoMatch as e:
        return None, e.reason
    return m, ""


def _probabilities(m: AttentionMatch, out: Node) -> tuple[Node, float, Node | None]:
    """Step 1: from ``p @ v`` back to the softmax over dropout, casts, clone, contiguous and a
    merge view ``(B, N, L, S) -> (B*N, L, S)``; returns (softmax, dropout p, merge view)."""
    dropout_p, node, consumer, merge = 0.0, out.args[0], out, None
    shared = None
    while _is(node, *_AFTER_SOFTMAX, *_VIEWS):
        if not single_user(node, consumer):
            shared = shared or node
        if _is(node, *_VIEWS):
            if merge is not None:
                raise _NoMatch("two views of the probabilities")
            merge = node
        if _op(node) == "dropout":
            if arg(node, 3, "inplace", False):
                raise _NoMatch("in-place dropout")
            if arg(node, 2, "training", True):  # F.dropout trains by default
                dropout_p = float(arg(node, 1, "p", 0.5))
        m.chain.append(node)
        consumer, node = node, node.args[0]
    if not _is(node, *_SOFTMAX):
        raise _NoMatch()
    if shared is not None:
        raise _NoMatch(f"{shared.name} (the attention probabilities) has other users")
    if not single_user(node, consumer):
        raise _NoMatch("the attention probabilities have other users")
    m.chain.append(node)
    return node, dropout_p, merge


def _softmax_input(softmax: Node) -> Node:
    """Step 2: the softmax is over the last dim; returns the scores it reads."""
    scores = softmax.args[0]
    info = tensor_info(scores)
    if info is None:
        raise _NoMatch("scores have no shape information")
    dim = arg(softmax, 1, "dim")
    if not isinstance(dim, int) or dim % info.ndim != info.ndim - 1:
        raise _NoMatch("softmax is not over the last dimension")
    return scores


def _scores(m: AttentionMatch, scores: Node, softmax: Node, merge: Node | None) -> Node:
    """Step 3: from the softmax input back to ``q @ k^T`` over scale factors, masks, casts and
    a split view; fills ``m.terms``/factors in graph order; returns the q @ k^T node."""
    node, consumer, split = scores, softmax, None
    steps: list[tuple[str, Any]] = []  # from the softmax back
    while True:
        if not isinstance(node, Node):
            raise _NoMatch()
        if not single_user(node, consumer):
            reads = _shape_reads(node, consumer) if consumer in node.users else None
            if reads is None:
                raise _NoMatch(f"{node.name} (the scores) has other users")
            m.shape_users += reads
        name = _op(node)
        if name in ("matmul", "bmm", "baddbmm"):
            break
        m.chain.append(node)
        if name in _CASTS:
            cont = node.args[0]
        elif name in _VIEWS:  # (B*N, L, S) <-> (B, N, L, S), the merge before or after the softmax
            info, src = tensor_info(node), tensor_info(node.args[0])
            merging = info is not None and src is not None and info.ndim == 3 and src.ndim == 4
            if merging and merge is None:
                merge = node
            elif not merging and split is None:
                split = node
            else:
                raise _NoMatch("views of the scores besides one split and its merge")
            cont = node.args[0]
            steps.append(("merge" if merging else "split", node))
        elif name == "add" and len(node.args) >= 2:
            a, b = node.args[:2]
            cont, mask = (a, b) if _leads_to_qk(a) else (b, a)
            if not _leads_to_qk(cont) or not isinstance(mask, Node):
                raise _NoMatch("an add that is not a mask")
            if node.target is operator.iadd and cont is not a:
                raise _NoMatch("mask += scores writes into the mask")  # others may read it later
            steps.append(("term", Term("add", mask)))
        elif name in ("masked_fill", "where"):
            got = _bool_mask(node)
            if got is None:
                raise _NoMatch("a masked_fill/where whose value is not very negative")
            cont, mask, is_fill, value = got
            steps.append(("term", Term("fill", mask, value, is_fill)))
            m.chain += [a for a in node.args if isinstance(a, Node) and static_number(a) is not None]
        elif (got := _scale_operand(node)) is not None:
            cont, factor, is_tensor = got
            steps.append(("scale", (factor, _is(node, "div"), is_tensor)))
            m.chain += [a for a in node.args if isinstance(a, Node) and static_number(a) is not None]
        else:
            raise _NoMatch()
        consumer, node = node, cont
    qk = node
    if (split is None) != (merge is None):
        raise _NoMatch("a view of the scores without its inverse")
    if split is not None:
        m.split = _split_shape(qk, split, merge)
    seen_term, flat = False, True
    for kind, what in reversed(steps):  # graph order
        if kind in ("split", "merge"):
            flat = kind == "merge"
        elif kind == "term":
            what.before_split = flat and split is not None
            m.terms.append(what)
            seen_term = True
        else:
            factor, divides, is_tensor = what
            if seen_term:
                raise _NoMatch("a scale applied after the mask")  # softmax((s + m) * c)
            (m.q_factors if is_tensor else m.scale_factors).append((factor, divides))
    return qk


def _split_shape(qk: Node, split: Node, merge: Node) -> tuple[int, int]:
    """(B, N) when ``split`` views (B*N, L, S) scores as (B, N, L, S) and ``merge`` undoes it."""
    s3, s4, back = tensor_info(qk), tensor_info(split), tensor_info(merge)
    if s3 is None or s4 is None or back is None or s3.ndim != 3 or s4.ndim != 4 \
            or s4.shape[2:] != s3.shape[1:] or s4.shape[0] * s4.shape[1] != s3.shape[0] \
            or back.shape != s3.shape:
        raise _NoMatch("views of the scores that only split and merge (B*N) are taken")
    return s4.shape[0], s4.shape[1]


def _qkv(m: AttentionMatch, qk: Node, v: Any) -> tuple[Node, Node, Node]:
    """Step 4: q, k (un-transposed) and v; baddbmm's bias becomes the first additive term."""
    m.chain.append(qk)
    if _op(qk) == "baddbmm":  # beta * bias + alpha * (q @ k^T)
        bias, q, kt = arg(qk, 0, "input"), arg(qk, 1, "batch1"), arg(qk, 2, "batch2")
        beta, alpha = _scalar(arg(qk, 3, "beta", 1.0)), _scalar(arg(qk, 4, "alpha", 1.0))
        if not isinstance(bias, Node) or not isinstance(beta, float) or alpha is None:
            raise _NoMatch("a baddbmm whose beta or alpha is not a number")
        if beta != 1.0:
            raise _NoMatch(f"a baddbmm with beta {beta} (the bias would need scaling)")
        m.scale_factors.insert(0, (alpha, False))
        m.terms.insert(0, Term("add", bias, before_split=m.split is not None))
    elif len(qk.args) == 2:
        q, kt = qk.args
    else:
        raise _NoMatch()
    if isinstance(kt, Node) and (got := _scale_operand(kt)) is not None and single_user(kt, qk):
        kt_inner, factor, is_tensor = got  # q @ (k^T * c): the factor joins the scale
        (m.q_factors if is_tensor else m.scale_factors).append((factor, _is(kt, "div")))
        m.chain.append(kt)
        kt = kt_inner
    if not isinstance(q, Node) or not isinstance(kt, Node) or not isinstance(v, Node):
        raise _NoMatch()
    k, m.k_needs_transpose = _untransposed(kt)
    if not m.k_needs_transpose:
        m.chain.append(kt)
    return q, k, v


def _spec(m: AttentionMatch, q: Node, k: Node, v: Node, dropout_p: float) -> AttentionSpec:
    """The facts the backend checks, after the dtype and mask checks."""
    q_info, k_info, v_info = tensor_info(q), tensor_info(k), tensor_info(v)
    if q_info is None or k_info is None or v_info is None:
        raise _NoMatch("q, k or v has no shape information")
    if not (q_info.dtype == k_info.dtype == v_info.dtype) or not q_info.dtype.is_floating_point:
        raise _NoMatch(f"q, k, v dtypes differ or are not floating ({q_info.dtype}, {k_info.dtype}, {v_info.dtype})")
    _check_dtypes(m, q_info.dtype)
    # k holds k^T when k_needs_transpose: its shape as (..., S, D) either way
    k_shape = k_info.shape if not m.k_needs_transpose else k_info.shape[:-2] + (k_info.shape[-1], k_info.shape[-2])
    q_shape, v_shape = q_info.shape, v_info.shape
    if m.split is not None:
        b, n = m.split
        q_shape, k_shape, v_shape = ((b, n) + s[1:] for s in (q_shape, k_shape, v_shape))
    scores_shape = q_shape[:-1] + (k_shape[-2],)
    masks = _check_terms(m, scores_shape, q_info.dtype)
    k_grouped, v_grouped = _before_repeat_kv(k), _before_repeat_kv(v)
    if k_grouped is None or v_grouped is None:
        k_grouped = v_grouped = None
    if len(q_shape) == len(k_shape) == len(v_shape) and q_shape[:-2] != k_shape[:-2] and \
            k_shape[:-2] == v_shape[:-2] and _broadcasts_batch(k_shape, q_shape):
        # one-head multi-query k/v (Falcon): expanded for SDPA, native on the NPU (Nq % 1 == 0)
        k_grouped, v_grouped = k, v
        m.k_expand, m.v_expand = q_shape[:-2] + k_shape[-2:], q_shape[:-2] + v_shape[-2:]
        k_shape, v_shape = m.k_expand, m.v_expand
    keep_mask = additive = bool_of_additive = None
    if len(m.terms) == 1 and m.terms[0].kind == "fill":
        keep_mask = m.terms[0].mask
    elif len(m.terms) == 1 and not _is_bool(m.terms[0].mask) and not m.terms[0].before_split:
        additive = m.terms[0].mask
        bool_of_additive = _keep_of_additive(additive)
    elif m.terms:
        additive = m.terms[0].mask  # combined at apply: one additive mask
    keep = keep_mask if keep_mask is not None else bool_of_additive
    if keep is not None and m.terms[0].fill_mask:
        keep = _inverted_source(keep)
    causal = scores_shape[-1] == scores_shape[-2] and keep is not None and \
        is_causal_keep_mask(keep[1] if isinstance(keep, tuple) else keep)
    return AttentionSpec(q=q, k=k, v=v, scale=_fold_scale(m.scale_factors), dropout_p=dropout_p,
                         keep_mask=keep_mask, additive_mask=additive, bool_of_additive=bool_of_additive,
                         q_shape=q_shape, k_shape=k_shape, v_shape=v_shape, dtype=q_info.dtype,
                         is_causal=causal, mask_shape=masks, k_grouped=k_grouped, v_grouped=v_grouped)


def _broadcasts_batch(k_shape: tuple[int, ...], q_shape: tuple[int, ...]) -> bool:
    return all(a in (1, b) for a, b in zip(k_shape[:-2], q_shape[:-2]))


def _check_dtypes(m: AttentionMatch, dtype: torch.dtype) -> None:
    """The rewrite computes in the dtype the original computed in, or declines. Between q @ k^T
    and p @ v the values may stay in q's dtype, or be upcast to float32 for the softmax and come
    back to q's dtype before p @ v (SDPA's and npu_fusion_attention's kernels compute the
    softmax of half inputs in float32); any other cast is declined with its dtype."""
    fp32 = torch.float32
    for node in m.chain:
        info = tensor_info(node)
        if info is None or not info.dtype.is_floating_point:
            continue
        if info.dtype not in (dtype, fp32):
            raise _NoMatch(f"{node.name} casts the attention to {info.dtype}; q is {dtype}")
    p_info = tensor_info(m.out.args[0])
    if p_info is None or p_info.dtype != dtype:
        got = p_info.dtype if p_info is not None else "unknown"
        raise _NoMatch(f"the probabilities reach p @ v as {got}; q is {dtype}: SDPA computes in q's dtype")


def _check_terms(m: AttentionMatch, scores_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...] | None:
    """Every mask broadcasts to the scores and is bool or q's dtype; returns their broadcast shape."""
    shapes = []
    for t in m.terms:
        info = tensor_info(t.mask)
        if info is None:
            raise _NoMatch("a mask has no shape information")
        shape = info.shape
        if t.before_split:
            shape = _split_mask_shape(shape, m.split)
        if not _broadcasts_shape(shape, scores_shape):
            raise _NoMatch("the mask does not broadcast to the scores")
        if t.kind == "add" and info.dtype not in (dtype, torch.bool):
            raise _NoMatch(f"additive mask dtype {info.dtype} differs from q's {dtype}")
        shapes.append(shape)
    return tuple(torch.broadcast_shapes(*shapes)) if shapes else None


def _split_mask_shape(shape: tuple[int, ...], split: tuple[int, int]) -> tuple[int, ...]:
    """A mask added to (B*N, L, S) scores, as seen by the (B, N, L, S) scores."""
    if len(shape) == 3 and shape[0] == split[0] * split[1]:
        return split + shape[1:]
    if len(shape) == 3 and shape[0] != 1:
        raise _NoMatch(f"a mask {list(shape)} on the (B*N, L, S) scores that does not split")
    return shape


def _broadcasts_shape(shape: tuple[int, ...], scores_shape: tuple[int, ...]) -> bool:
    return len(shape) <= len(scores_shape) and \
        all(a in (1, b) for a, b in zip(reversed(shape), reversed(scores_shape)))


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
    """True when scale ops, casts and views lead from ``node`` to q @ k^T (the scores side of an add)."""
    while isinstance(node, Node):
        if _is(node, "matmul", "bmm", "baddbmm"):
            return True
        if _is(node, *_CASTS, *_VIEWS):
            node = node.args[0]
        elif (got := _scale_operand(node)) is not None:
            node = got[0]
        elif _is(node, "masked_fill", "where") and (got := _bool_mask(node)) is not None:
            node = got[0]
        elif _is(node, "add") and len(node.args) >= 2:
            node = node.args[0] if _leads_to_qk(node.args[0]) else node.args[1]
        else:
            return False
    return False


def _bool_mask(node: Node) -> tuple[Any, Node, bool, float] | None:
    """(continuation, mask, is_fill_mask, fill value) for ``masked_fill(x, m, -big)`` and
    ``where(keep, x, -big)``; the fill a number or a 0-d constant (``torch.full((), -inf)``)."""
    if _op(node) == "masked_fill":
        x, m, value = node.args[0], arg(node, 1, "mask"), static_number(arg(node, 2, "value"))
        if value is not None and value <= _VERY_NEGATIVE and _is_bool(m):
            return x, m, True, value
        return None
    cond, a, b = (list(node.args) + [None, None, None])[:3]
    if not _is_bool(cond):
        return None
    va, vb = static_number(a), static_number(b)
    if vb is not None and vb <= _VERY_NEGATIVE and va is None and isinstance(a, Node):
        return a, cond, False, vb
    if va is not None and va <= _VERY_NEGATIVE and vb is None and isinstance(b, Node):
        return b, cond, True, va
    return None


def _is_bool(node: Any) -> bool:
    info = tensor_info(node)
    return info is not None and info.dtype == torch.bool


def _untransposed(kt: Node) -> tuple[Node, bool]:
    """(k, False) when ``kt`` swaps k's last two dims (``transpose(-2, -1)``,
    ``permute(0, 1, 3, 2)``), else (kt, True)."""
    info = tensor_info(kt)
    if info is None or len(kt.users) != 1:
        return kt, True
    n = info.ndim
    if _is(kt, "transpose"):
        dims = {d % n for d in (arg(kt, 1, "dim0"), arg(kt, 2, "dim1")) if isinstance(d, int)}
        if dims == {n - 2, n - 1}:
            return kt.args[0], False
    if _is(kt, "permute"):
        perm = kt.args[1:] if len(kt.args) > 2 else kt.args[1] if len(kt.args) == 2 else arg(kt, 1, "dims")
        if list(perm or ()) == list(range(n - 2)) + [n - 1, n - 2]:
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
    version = 2  # the NPU decode step as npu_fused_infer_attention_score
    contract = "exact"
    fused_kind = "attention"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for node in gm.graph.nodes:
            match, reason = _match(node)
            if match is None:
                if reason:
                    ctx.decline(f"{self.name} at {node.name}", reason)
                continue
            reason = ctx.backend.cannot_fuse_attention(match.spec, ctx.training)
            if reason is not None:
                ctx.decline(f"{self.name} at {node.name}", reason)
                continue
            sites.append(Site(node, _describe(node, match), match))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        graph = gm.graph
        for site in sites:
            m: AttentionMatch = site.match
            remap = _expand_shape_reads(graph, m)
            with graph.inserting_before(m.out):
                new = _emit(graph, m, remap, ctx)
            replace_node(m.out, new, self.name, m.chain)


def _describe(node: Node, m: AttentionMatch) -> str:
    s = m.spec
    mask = "causal" if s.is_causal else "additive mask" if s.additive_mask is not None else (
        "boolean mask" if s.keep_mask is not None else "no mask")
    if len(m.terms) > 1:
        mask = f"{len(m.terms)} masks combined into one additive mask"
    if s.k_grouped is not None:
        mask += ", grouped k/v" if m.k_expand is None else ", multi-query k/v"
    scale = f"{s.scale:.4g}" if s.scale is not None else "computed at run time"
    if m.q_factors:
        scale += " and a tensor (applied to q)"
    return (f"{node.name}: q{list(s.q_shape)} k{list(s.k_shape)}, {mask}, scale {scale}, "
            f"dropout {s.dropout_p:g}")


def _expand_shape_reads(graph: Any, m: AttentionMatch) -> dict[Node, Node]:
    """``mask.expand_as(scores)`` -> ``mask.expand(shape)``: the scores are going away."""
    remap = {}
    for u in m.shape_users:
        with graph.inserting_before(u):
            e = graph.call_method("expand", (u.args[0], tuple(tensor_info(u.args[1]).shape)))
        mark_new_node(e, FuseAttention.name, like=u)
        u.replace_all_uses_with(e)
        graph.erase_node(u)
        remap[u] = e
    return remap


def _emit(graph: Any, m: AttentionMatch, remap: dict[Node, Node], ctx: PassContext) -> Node:
    """The fused call standing for ``m.out``, inserted at the current point."""
    spec = m.spec
    q, k, v = spec.q, spec.k, spec.v
    for f, divides in m.q_factors:  # a 0-d tensor scale: exact up to rounding, keeps its grad
        q = graph.call_function(operator.truediv if divides else operator.mul, (q, f))
    if m.k_needs_transpose:
        k = graph.call_function(torch.transpose, (k, -2, -1))
    if m.split is not None:  # (B*N, L, D) -> (B, N, L, D): the fused op sees the heads
        q, k, v = (graph.call_method("reshape", (x, shape))
                   for x, shape in ((q, spec.q_shape), (k, spec.k_shape), (v, spec.v_shape)))
    changes: dict[str, Any] = {"q": q, "k": k, "v": v, "scale": _emit_scale(graph, m.scale_factors)}
    if m.k_expand is not None:  # SDPA takes equal batch dims; the NPU kernel takes one head as is
        changes.update(k_grouped=k, v_grouped=v, k=graph.call_method("expand", (k, m.k_expand)),
                       v=graph.call_method("expand", (v, m.v_expand)))
    single_fill = len(m.terms) == 1 and m.terms[0].kind == "fill"
    if single_fill:
        t = m.terms[0]
        mask = remap.get(t.mask, t.mask)
        changes["keep_mask"] = mask if spec.is_causal or not t.fill_mask else _negated(graph, mask)
    elif isinstance(spec.bool_of_additive, tuple):
        _, cond, index = spec.bool_of_additive
        changes["bool_of_additive"] = graph.call_function(operator.getitem, (cond, index))
    if m.terms and not single_fill and spec.bool_of_additive is None:
        changes["additive_mask"] = _emit_combined_mask(graph, m, remap, q)
    new = ctx.backend.emit_attention(graph, dataclasses.replace(spec, **changes), ctx.training)
    if m.k_expand is not None:
        erase_if_unused(graph, [changes["k"], changes["v"]])  # a backend that took the one head
    if m.split is not None:
        new = graph.call_method("reshape", (new, tuple(tensor_info(m.out).shape)))
    return new


def _emit_combined_mask(graph: Any, m: AttentionMatch, remap: dict[Node, Node], like: Node) -> Node:
    """One additive mask for the terms, in graph order: ``+ m`` adds (a bool adds 0/1, never a
    keep mask), a fill is ``where(keep, total, fill)`` (s + fill rounds to fill for the very
    negative fills taken, or underflows in exp like the original)."""
    total = None
    for t in m.terms:
        mask = remap.get(t.mask, t.mask)
        if t.before_split:
            shape = tensor_info(t.mask).shape
            if shape[0] != 1:
                mask = graph.call_method("reshape", (mask, _split_mask_shape(shape, m.split)))
        if t.kind == "add":
            if _is_bool(t.mask):
                mask = graph.call_method("to", (mask, m.spec.dtype))
            total = mask if total is None else graph.call_function(operator.add, (total, mask))
        else:
            keep = _negated(graph, mask) if t.fill_mask else mask
            base = total if total is not None else graph.call_method("new_zeros", (like, ()))
            total = graph.call_function(torch.where, (keep, base, t.value))
    return total


register_pass(FuseAttention())
