"""fuse_linear: a matmul with a transposed weight, plus a bias, into one ``F.linear``.

Rewrites (``w`` 2-D (out, in), ``b`` 1-D (out,) or absent)::

    torch.matmul(x, w.t()) + b      ->  F.linear(x, w, b)
    x @ w.T + b                     ->  F.linear(x, w, b)
    torch.addmm(b, x, w.t())        ->  F.linear(x, w, b)
    torch.matmul(x, w.t())          ->  F.linear(x, w)

The NPU tuning guide's worked MatMul case: a weight transposed on the fly and fed to matmul
([256,1024] x [1024,256]) costs a non-contiguous copy and a separate bias add; ``F.linear``
takes the weight in its stored layout and fuses the bias into the GEMM epilogue.

Safe when: the transpose is of the last two dims of a 2-D tensor, the bias broadcasts only
along the output features, and the matmul result has no other user (else it must stay).
Contract: exact (one GEMM either way; rounding of the bias add may differ).
Devices: cpu, cuda, npu (F.linear on all three; torch_npu maps it to its MatMul kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.ir import arg, is_op, op_name, replace_node, tensor_info
from rewriter.pass_api import Pass, PassContext, Site, register_pass


@dataclass
class LinearMatch:
    out: Node           # the node whose users get F.linear's result
    x: Node
    weight: Node
    bias: Node | None
    dead: list[Node]    # nodes that become unused, producer first


def _weight_of_transpose(node: object) -> Node | None:
    """``w`` when ``node`` is ``w.t()``, ``w.T`` or ``w.transpose(0, 1)`` of a 2-D ``w``."""
    if not isinstance(node, Node):
        return None
    name = op_name(node)
    src = node.args[0] if node.args else None
    info = tensor_info(src)
    if info is None or info.ndim != 2:
        return None
    if name in ("t", "mT"):
        return src
    if name == "transpose" and {arg(node, 1, "dim0") % 2, arg(node, 2, "dim1") % 2} == {0, 1}:
        return src
    if name == "permute":
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        if tuple(d % 2 for d in dims) == (1, 0):
            return src
    return None


def _bias_fits(bias: object, weight: Node) -> bool:
    b, w = tensor_info(bias), tensor_info(weight)
    return b is not None and w is not None and b.shape == (w.shape[0],) and b.dtype == w.dtype


def can_fuse_matmul(mm: Node) -> tuple[Node, Node] | None:
    """(x, w) when ``mm`` is ``matmul(x, w^T)`` with a 2-D ``w`` and ``x`` of matching width."""
    if not is_op(mm, "matmul") or len(mm.args) != 2:
        return None
    x, wt = mm.args
    w = _weight_of_transpose(wt)
    xi, wi = tensor_info(x), tensor_info(w)
    if w is None or xi is None or wi is None or xi.ndim < 1 or xi.shape[-1] != wi.shape[1]:
        return None
    if xi.dtype != wi.dtype:
        return None
    return x, w


def _match_add(add: Node) -> LinearMatch | None:
    if not is_op(add, "add") or len(add.args) != 2 or add.kwargs:
        return None
    for mm, bias in (add.args, reversed(add.args)):
        if isinstance(mm, Node) and len(mm.users) == 1 and (xw := can_fuse_matmul(mm)):
            if _bias_fits(bias, xw[1]):
                return LinearMatch(add, xw[0], xw[1], bias, [mm.args[1], mm])
    return None


def _match_addmm(node: Node) -> LinearMatch | None:
    if not is_op(node, "addmm") or len(node.args) != 3 or node.kwargs:
        return None  # beta/alpha scale the terms: not a plain linear
    bias, x, wt = node.args
    w = _weight_of_transpose(wt)
    if w is None or not _bias_fits(bias, w):
        return None
    return LinearMatch(node, x, w, bias, [wt])


def _match_bare_matmul(node: Node) -> LinearMatch | None:
    xw = can_fuse_matmul(node)
    if xw is None:
        return None
    # A matmul feeding a fusable bias add is matched by _match_add instead.
    if len(node.users) == 1 and _match_add(next(iter(node.users))) is not None:
        return None
    return LinearMatch(node, xw[0], xw[1], None, [node.args[1]])


class FuseLinear(Pass):
    name = "fuse_linear"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for node in gm.graph.nodes:
            match = _match_add(node) or _match_addmm(node) or _match_bare_matmul(node)
            if match is not None:
                shape = tensor_info(match.weight).shape  # type: ignore[union-attr]
                kind = "with bias" if match.bias is not None else "no bias"
                sites.append(Site(match.out, f"{node.name}: linear {shape[1]}->{shape[0]} ({kind})", match))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        graph = gm.graph
        for site in sites:
            m: LinearMatch = site.match
            with graph.inserting_before(m.out):
                args = (m.x, m.weight) if m.bias is None else (m.x, m.weight, m.bias)
                new = graph.call_function(F.linear, args)
            replace_node(m.out, new, self.name, m.dead)


register_pass(FuseLinear())
