"""fuse_qkv_projections: linears that read the same input into one wider linear, then split.

Rewrites (``W_i`` of shape (out_i, in), biases all present or all absent)::

    q = F.linear(x, Wq, bq); k = F.linear(x, Wk, bk); v = F.linear(x, Wv, bv)
  ->
    q, k, v = F.linear(x, torch.cat([Wq, Wk, Wv]), torch.cat([bq, bk, bv])).split([oq, ok, ov], -1)

One GEMM of width sum(out_i) instead of several narrow ones (the attention projections, or
LLaMA's gate/up pair). The weights are concatenated in the graph at every call, so the model
keeps its own parameters: ``state_dict()`` keys are unchanged and stay loadable, gradients reach
each original weight, and a weight loaded later is used.
Safe when: two or more linears share the input node, same dtype, all with or all without bias.
Contract: exact (the same dot products; only the GEMM blocking differs).
Devices: cpu, cuda, npu.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.capture.ir import (
    arg,
    hoist_reads,
    is_op,
    is_parameter_like,
    mark_new_node,
    tensor_info,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass


def _linear_parts(node: Node) -> tuple[Node, Node, Node | None] | None:
    if not is_op(node, "linear"):
        return None
    x, w, b = node.args[0], arg(node, 1, "weight"), arg(node, 2, "bias")
    w_info = tensor_info(w)
    if not isinstance(x, Node) or w_info is None or w_info.ndim != 2:
        return None
    # Parameters only (fx get_attr, Dynamo placeholders): a computed weight may be defined after
    # the first linear of the group, where the merged linear has to go.
    if not (is_parameter_like(w) and is_parameter_like(b)):
        return None
    return x, w, b


def groups(gm: GraphModule) -> list[list[Node]]:
    """Linears grouped by shared input (2 or more per group, compatible bias and dtype)."""
    by_input: dict[tuple, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        parts = _linear_parts(node)
        if parts is None:
            continue
        x, w, b = parts
        info = tensor_info(w)
        by_input[(x, b is None, info.dtype, info.shape[1])].append(node)  # type: ignore[union-attr]
    return [nodes for nodes in by_input.values() if len(nodes) >= 2]


class FuseQkvProjections(Pass):
    name = "fuse_qkv_projections"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for nodes in groups(gm):
            widths = [tensor_info(n.args[1]).shape[0] for n in nodes]  # type: ignore[union-attr]
            sites.append(Site(nodes[0], f"{', '.join(n.name for n in nodes)}: {len(nodes)} linears "
                                        f"{'+'.join(map(str, widths))} wide, one input", nodes))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            nodes: list[Node] = site.match
            first = min(nodes, key=lambda n: list(g.nodes).index(n))
            x = nodes[0].args[0]
            weights = [arg(n, 1, "weight") for n in nodes]
            biases = [arg(n, 2, "bias") for n in nodes]
            widths = [tensor_info(w).shape[0] for w in weights]  # type: ignore[union-attr]
            hoist_reads(first, weights + biases)
            with g.inserting_before(first):
                w = g.call_function(torch.cat, (weights, 0))
                b = g.call_function(torch.cat, (biases, 0)) if biases[0] is not None else None
                fused = mark_new_node(g.call_function(F.linear, (x, w, b)), self.name)
                parts = g.call_function(torch.split, (fused, widths, -1))
                for i, n in enumerate(nodes):
                    piece = mark_new_node(g.call_function(operator.getitem, (parts, i)), self.name, like=n)
                    n.replace_all_uses_with(piece)
            for n in nodes:
                g.erase_node(n)


register_pass(FuseQkvProjections())
