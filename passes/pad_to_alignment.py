"""pad_to_alignment: matmul/linear inner dimensions zero-padded to the device's alignment.

Rewrites (``K`` the reduced dimension, ``N`` the output width; ``Kp``, ``Np`` the padded sizes)::

    y = F.linear(x, W, b)          # W (N, K), b (N,)
  ->
    y = F.linear(F.pad(x, (0, Kp-K)), F.pad(W, (0, Kp-K, 0, Np-N)), F.pad(b, (0, Np-N)))
    y = torch.narrow(y, -1, 0, N).contiguous()

    y = torch.matmul(a, b)         # a (..., M, K), b (..., K, N); torch.bmm the same
  ->
    y = torch.matmul(F.pad(a, (0, Kp-K)), F.pad(b, (0, Np-N, 0, Kp-K)))
    y = torch.narrow(y, -1, 0, N).contiguous()   # N of Np columns, row-major as before

Only what is misaligned is padded (K, N or both); M (rows) is left alone: the vendor rule is about
the inner (last) axis of both inputs (reference npu_ecosystem.md §4.1, advisor "AI Core
Performance"; §6 "Alignment"). The padding is in the graph at every call, from the live tensors,
so parameters stay as they are (state_dict, gradients through F.pad's backward, weights loaded
later). A dimension whose size is fixed (a weight's, or computed only from weights) is padded by a
constant; any other (activations: an fx graph serves every input shape) by ``(-size) % align``
computed in the graph from ``size()``, so another input shape still pads correctly. Several
linears reading one input share its padded copy (unless something writes in place between them).
A bias that broadcasts over N ((1,) or 0-d) is left as it is.

Alignment: ``ctx.backend.matmul_alignment`` (NPU 16: the Cube's 16x16 fractal; CUDA 8: tensor
cores). The CPU backend declares none (1); this pass tries ``CPU_CANDIDATE_ALIGNMENT`` = 16 (one
64-byte cache line / AVX-512 register of fp32) and the gate decides. On NPU, a fixed dimension
is padded to a multiple of 128 instead when that costs at most 1/8 more (the tuning guide: "a
dimension that is a multiple of 128 runs best"). Dimensions that are already multiples of the
alignment are left alone, 128 or not: the guide's hidden size 1024 -> 1152 (12.4 ms -> 0.9 ms
MatMul, seeds/004) was a model-configuration change made together with removing a transposed
weight; 1024 is a multiple of 128 and padding it is not what that case supports. On other shapes
padding only adds copies, which is why the pass is gated.

Safe when: floating dtypes (integer GEMMs are not taken), both matmul operands at least 2-D, a
2-D linear weight. Each of K and N is padded only when that adds at most 25% to it (a smaller
dimension is padded into the device's own tiles anyway; padding it only adds a copy).
Contract: exact. The padded products are 0 * 0 (never 0 * inf), and the padded output columns
are sliced off; only the GEMM's blocking over the longer K may change fp32 rounding.
Devices: cpu, cuda, npu.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from rewriter.capture.ir import (
    arg,
    hoist_reads,
    is_op,
    mark_new_node,
    static_tensor,
    tensor_info,
    written_between,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass

# The CPU backend declares no alignment; this is the candidate the gate measures there.
CPU_CANDIDATE_ALIGNMENT = 16
# A larger multiple the device prefers, used when it costs at most PREFERRED_MAX_OVERHEAD more.
PREFERRED_ALIGNMENT = {"npu": 128}
PREFERRED_MAX_OVERHEAD = 1 / 8
# Padding that grows a dimension by more than this is declined.
MAX_GROWTH = 1 / 4


@dataclass
class PadMatch:
    node: Node            # the linear / matmul / bmm whose users get the sliced result
    kind: str             # "linear" | "matmul"
    k: int                # sizes on the example inputs
    n: int
    k_to: int             # padded sizes on the example inputs (k when K is not padded)
    n_to: int
    k_fixed: bool         # the size cannot change between calls: padded by a constant
    n_fixed: bool

    @property
    def pad_k(self) -> bool:
        return self.k_to != self.k

    @property
    def pad_n(self) -> bool:
        return self.n_to != self.n


def alignment_for(ctx: PassContext) -> int:
    """The multiple this pass pads to on ``ctx``'s device."""
    align = ctx.backend.matmul_alignment
    return align if align > 1 else CPU_CANDIDATE_ALIGNMENT


def padded_size(size: int, align: int, preferred: int | None = None) -> int:
    """``size`` rounded up to ``align`` (or to ``preferred`` when that costs little more)."""
    up = -(-size // align) * align
    if preferred:
        up_preferred = -(-size // preferred) * preferred
        if up_preferred - size <= size * PREFERRED_MAX_OVERHEAD:
            return max(up, up_preferred)
    return up


def _fixed_shape(node: object, seen: dict[Node, bool] | None = None) -> bool:
    """True when ``node``'s shape cannot change between calls: a model tensor, or computed only
    from model tensors and constants (``torch.cat([Wq, Wk, Wv])``)."""
    if not isinstance(node, Node):
        return True
    seen = {} if seen is None else seen
    if node not in seen:
        if node.op == "get_attr" or static_tensor(node) is not None:
            seen[node] = True
        elif node.op in ("call_function", "call_method"):
            seen[node] = all(_fixed_shape(a, seen) for a in node.all_input_nodes)
        else:
            seen[node] = False  # a graph input: its shape is the caller's
    return seen[node]


def _target_size(size: int, align: int, preferred: int | None) -> int:
    """What ``size`` is padded to: itself when aligned or when padding would add too much."""
    if size % align == 0:
        return size
    to = padded_size(size, align, preferred)
    return size if to - size > size * MAX_GROWTH else to


def can_pad(node: Node, align: int, preferred: int | None) -> tuple[PadMatch | None, str]:
    """The padding ``node`` takes, or None and why not."""
    if is_op(node, "linear"):
        a, w = arg(node, 0, "input"), arg(node, 1, "weight")
        ai, wi = tensor_info(a), tensor_info(w)
        if ai is None or wi is None:
            return None, "shapes unknown"
        if wi.ndim != 2:
            return None, f"weight is {wi.ndim}-D"
        n, k = wi.shape
        kind = "linear"
    elif is_op(node, "matmul", "bmm") and len(node.args) == 2 and not node.kwargs:
        a, w = node.args
        ai, wi = tensor_info(a), tensor_info(w)
        if ai is None or wi is None:
            return None, "shapes unknown"
        if ai.ndim < 2 or wi.ndim < 2:
            return None, "a 1-D operand (matrix-vector product)"
        k, n = ai.shape[-1], wi.shape[-1]
        kind = "matmul"
    else:
        return None, "not a linear, matmul or bmm"
    if not (ai.dtype.is_floating_point and wi.dtype.is_floating_point):
        return None, f"dtype {ai.dtype}/{wi.dtype} is not floating point"
    if k % align == 0 and n % align == 0:
        return None, f"K={k}, N={n} already multiples of {align}"
    # A size that may change between calls is padded to the alignment, computed in the graph;
    # the preferred multiple is for fixed sizes only.
    k_fixed, n_fixed = _fixed_shape(w) or _fixed_shape(a), _fixed_shape(w)
    # Each dimension on its own: a misaligned K is worth padding even when N is too small to.
    k_to = _target_size(k, align, preferred if k_fixed else None)
    n_to = _target_size(n, align, preferred if n_fixed else None)
    if k_to == k and n_to == n:
        return None, f"padding K={k} or N={n} to {align} would grow it by more than {MAX_GROWTH:.0%}"
    return PadMatch(node, kind, k, n, k_to, n_to, k_fixed, n_fixed), ""


class PadToAlignment(Pass):
    name = "pad_to_alignment"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        align, preferred = alignment_for(ctx), PREFERRED_ALIGNMENT.get(ctx.backend.name)
        sites = []
        for node in gm.graph.nodes:
            m, _ = can_pad(node, align, preferred)
            if m is not None:
                dims = [f"{name} {size}->{to}" for name, size, to in (("K", m.k, m.k_to), ("N", m.n, m.n_to))
                        if to != size]
                sites.append(Site(node, f"{node.name}: {m.kind} {', '.join(dims)}", m))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        align = alignment_for(ctx)
        padded_inputs: dict[tuple[Node, int], Node] = {}  # x padded once when several linears read it
        for site in sites:
            m: PadMatch = site.match
            node = m.node
            if m.kind == "linear":
                a, w, bias = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
                n_dim = 0                    # W (N, K)
            else:
                (a, w), bias = node.args, None
                n_dim = -1                   # b (..., K, N)
            hoist_reads(node, (a, w, bias))
            w_orig = w
            with g.inserting_before(node):
                pk: int | Node = 0
                pn: int | Node = 0
                if m.pad_k:
                    pk = m.k_to - m.k if m.k_fixed else _pad_in_graph(g, a, -1, align)
                if m.pad_n:
                    pn = m.n_to - m.n if m.n_fixed else _pad_in_graph(g, w, n_dim, align)
                if isinstance(pk, int) and pk:
                    if (a, pk) in padded_inputs and written_between(padded_inputs[(a, pk)], node):
                        del padded_inputs[(a, pk)]  # a write in between: that copy is stale
                    if (a, pk) not in padded_inputs:
                        padded_inputs[(a, pk)] = self._pad(g, a, (0, pk))
                    a = padded_inputs[(a, pk)]
                elif m.pad_k:
                    a = self._pad(g, a, (0, pk))
                if m.kind == "linear":
                    w = self._pad(g, w, (0, pk, 0, pn))  # W (N, K): K last, N before it
                    if m.pad_n and bias is not None and _bias_spans_n(bias, m.n):
                        bias = self._pad(g, bias, (0, pn))  # a (1,) or 0-d bias broadcasts as is
                    new = g.call_function(F.linear, (a, w) if bias is None else (a, w, bias))
                else:
                    w = self._pad(g, w, (0, pn, 0, pk))  # b (..., K, N): N last, K before it
                    new = g.call_function(torch.bmm if is_op(node, "bmm") else torch.matmul, (a, w))
                if m.pad_n:
                    mark_new_node(new, self.name)  # its (padded) facts are filled in afterwards
                    n: int | Node = m.n if m.n_fixed else g.call_method("size", (w_orig, n_dim))
                    new = mark_new_node(g.call_function(torch.narrow, (new, -1, 0, n)), self.name)
                    # The N of Np columns are strided: contiguous again, as the product was
                    # (a reader's or the caller's .view() needs it).
                    new = g.call_method("contiguous", (new,))
                mark_new_node(new, self.name, like=node)
            node.replace_all_uses_with(new)
            g.erase_node(node)

    def _pad(self, g: Graph, value: Node, pad: tuple) -> Node:
        return mark_new_node(g.call_function(F.pad, (value, pad)), self.name)


def _bias_spans_n(bias: object, n: int) -> bool:
    """The bias has the output's N columns (not a (1,) or 0-d bias that broadcasts over them)."""
    info = tensor_info(bias)
    return info is None or (info.ndim >= 1 and info.shape[-1] == n)


def _pad_in_graph(g: Graph, value: Node, dim: int, align: int) -> Node:
    """``(-value.size(dim)) % align``, computed at each call: right for every input shape (0 when
    that call's size happens to be aligned)."""
    size = g.call_method("size", (value, dim))
    return g.call_function(operator.mod, (g.call_function(operator.neg, (size,)), align))


register_pass(PadToAlignment())
