"""fuse_one_hot: a one-hot matrix multiplied by a weight into a gather (``F.embedding``).

Rewrites (``W`` of shape (n, d) for matmul, (d, n) for linear)::

    F.one_hot(idx, n).to(float) @ W           -> F.embedding(idx, W)
    F.linear(F.one_hot(idx, n).float(), W, b) -> F.embedding(idx, W.t()) + b

No (…, n) one-hot tensor and no GEMM: a row gather. Each output element of the original is a
sum with one non-zero term, so the gather computes the same numbers.
Not done: a lone ``one_hot`` into ``torch_npu.npu_one_hot`` — that op is deprecated (kernel no
longer maintained, reference npu_ecosystem.md §1.14 and pitfall 4), so rewriter does not emit it.
Safe when: the one-hot and its cast feed only the product, ``n`` is given, W's rows are the
classes.
Contract: exact.
Devices: cpu, cuda, npu.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.ir import arg, is_cast, is_op, replace_node, single_user, tensor_info
from rewriter.pass_api import Pass, PassContext, Site, register_pass


@dataclass
class OneHotMatch:
    idx: Node
    weight: Node
    transposed: bool   # linear: W is (d, n)
    bias: Node | None
    out: Node
    dead: list[Node]


def match(node: Node) -> OneHotMatch | None:
    if is_op(node, "matmul") and len(node.args) == 2:
        oh, w, transposed, bias = node.args[0], node.args[1], False, None
    elif is_op(node, "linear"):
        oh, w, transposed, bias = node.args[0], arg(node, 1, "weight"), True, arg(node, 2, "bias")
    else:
        return None
    dead = []
    if is_cast(oh) and single_user(oh, node):
        dead.append(oh)
        cast, oh = oh, oh.args[0]
        if not single_user(oh, cast):
            return None
    elif not single_user(oh, node):
        return None
    if not is_op(oh, "one_hot"):
        return None
    n = arg(oh, 1, "num_classes", -1)
    w_info = tensor_info(w)
    if not isinstance(n, int) or n < 1 or w_info is None or w_info.ndim != 2:
        return None
    if w_info.shape[1 if transposed else 0] != n:
        return None
    return OneHotMatch(oh.args[0], w, transposed, bias, node, [oh] + dead)


class FuseOneHot(Pass):
    name = "fuse_one_hot"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        return [Site(n, f"{n.name}: one_hot @ weight -> embedding", m)
                for n in gm.graph.nodes if (m := match(n)) is not None]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: OneHotMatch = site.match
            with g.inserting_before(m.out):
                table = g.call_function(torch.t, (m.weight,)) if m.transposed else m.weight
                new = g.call_function(F.embedding, (m.idx, table))
                if m.bias is not None:
                    new = g.call_function(operator.add, (new, m.bias))
            replace_node(m.out, new, self.name, list(reversed(m.dead)))


register_pass(FuseOneHot())
