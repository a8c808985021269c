"""fold_batch_norm: a convolution or linear followed by eval-mode BatchNorm, folded into one.

Rewrites (inference only; ``s = bn_w / sqrt(running_var + eps)``)::

    F.batch_norm(F.conv2d(x, W, b, ...), mean, var, bn_w, bn_b, training=False, eps=eps)
  ->
    F.conv2d(x, W * s[:, None, None, None], (b - mean) * s + bn_b, ...)
  (the same for conv1d/conv3d and linear)

The folded weight is computed in the graph from the live parameters and running statistics at
each call (a few element-wise ops on the weights, small beside the convolution), so the model's
own tensors stay as they are and a checkpoint loaded later is honoured.
Safe when: the BatchNorm is in eval mode (``training=False``), has running statistics, and the
convolution's output feeds nothing else.
Contract: exact up to fp32 rounding (the scale multiplies the weight instead of the output).
Devices: cpu, cuda, npu.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from rewriter.ir import (
    arg,
    hoist_reads,
    is_op,
    is_parameter_like,
    mark_new_node,
    single_user,
    tensor_info,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass


def match(bn: Node) -> Node | None:
    """The conv/linear node feeding eval-mode ``bn``, when foldable."""
    if not is_op(bn, "batch_norm") or arg(bn, 5, "training", False) is not False:
        return None
    producer = bn.args[0]
    if not (is_op(producer, "conv", "linear") and single_user(producer, bn)):
        return None
    if arg(bn, 1, "running_mean") is None or arg(bn, 2, "running_var") is None:
        return None
    if not all(is_parameter_like(a) for a in bn.args[1:5]):
        return None  # statistics computed in the graph: not a plain eval-mode BatchNorm
    w = tensor_info(arg(producer, 1, "weight"))
    return producer if w is not None else None


class FoldBatchNorm(Pass):
    name = "fold_batch_norm"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if ctx.training:
            return []  # BatchNorm in training normalises by batch statistics: nothing to fold
        return [Site(n, f"{p.name} + {n.name}: batch norm folded", p)
                for n in gm.graph.nodes if (p := match(n)) is not None]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            bn: Node = site.anchor
            producer: Node = site.match
            mean, var = arg(bn, 1, "running_mean"), arg(bn, 2, "running_var")
            bn_w, bn_b, eps = arg(bn, 3, "weight"), arg(bn, 4, "bias"), arg(bn, 7, "eps", 1e-5)
            w, b = arg(producer, 1, "weight"), arg(producer, 2, "bias")
            ndim = tensor_info(w).ndim  # type: ignore[union-attr]
            hoist_reads(producer, (mean, var, bn_w, bn_b))
            with g.inserting_before(producer):
                inv = g.call_function(torch.rsqrt, (g.call_function(operator.add, (var, eps)),))
                scale = g.call_function(operator.mul, (inv, bn_w)) if bn_w is not None else inv
                w_scale = g.call_function(torch.reshape, (scale, (-1,) + (1,) * (ndim - 1)))
                new_w = g.call_function(operator.mul, (w, w_scale))
                centered = g.call_function(operator.sub, (b, mean)) if b is not None else \
                    g.call_function(operator.neg, (mean,))
                new_b = g.call_function(operator.mul, (centered, scale))
                if bn_b is not None:
                    new_b = g.call_function(operator.add, (new_b, bn_b))
            args = list(producer.args)
            args[1] = new_w
            if len(args) > 2:
                args[2] = new_b
                producer.args = tuple(args)
            else:
                producer.args = tuple(args)
                producer.kwargs = {**producer.kwargs, "bias": new_b}
            mark_new_node(producer, self.name)
            bn.replace_all_uses_with(producer)
            g.erase_node(bn)


register_pass(FoldBatchNorm())
