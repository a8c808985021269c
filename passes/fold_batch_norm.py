"""fold_batch_norm: a convolution or linear followed by eval-mode BatchNorm, folded into one.

A rule table (``rewriter.rules``; inference only; ``s = bn_w / sqrt(running_var + eps)``)::

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
import torch.nn.functional as F

from rewriter.capture.ir import hoist_reads, is_parameter_like
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass


def conv_batch_norm_pattern(x, w, b, stride, padding, dilation, groups, mean, var, bn_w, bn_b, momentum, eps):
    # "conv" is one op for conv1d/2d/3d (rewriter.capture.ir): the replacement calls the model's own
    y = F.conv2d(x, w, b, stride, padding, dilation, groups)
    return F.batch_norm(y, mean, var, bn_w, bn_b, False, momentum, eps)


def linear_batch_norm_pattern(x, w, b, mean, var, bn_w, bn_b, momentum, eps):
    return F.batch_norm(F.linear(x, w, b), mean, var, bn_w, bn_b, False, momentum, eps)


def has_running_statistics(m: Match) -> bool:
    # statistics computed in the graph would not be a plain eval-mode BatchNorm
    stats = [m[k] for k in ("mean", "var", "bn_w", "bn_b")]
    return m["mean"] is not None and m["var"] is not None and all(is_parameter_like(a) for a in stats) \
        and m.info("w") is not None and m.number("eps") is not None


def _folded(g, m: Match, ctx: PassContext):
    producer = _producer(m)
    mean, var, bn_w, bn_b = m["mean"], m["var"], m["bn_w"], m["bn_b"]
    w, b = m["w"], m["b"]
    hoist_reads(m.root, (mean, var, bn_w, bn_b))
    inv = g.call_function(torch.rsqrt, (g.call_function(operator.add, (var, m.number("eps"))),))
    scale = g.call_function(operator.mul, (inv, bn_w)) if bn_w is not None else inv
    w_scale = g.call_function(torch.reshape, (scale, (-1,) + (1,) * (m.info("w").ndim - 1)))
    new_w = g.call_function(operator.mul, (w, w_scale))
    centered = g.call_function(operator.sub, (b, mean)) if b is not None else g.call_function(operator.neg, (mean,))
    new_b = g.call_function(operator.mul, (centered, scale))
    if bn_b is not None:
        new_b = g.call_function(operator.add, (new_b, bn_b))
    if "stride" in m.values:
        args = (m["x"], new_w, new_b, m["stride"], m["padding"], m["dilation"], m["groups"])
    else:
        args = (m["x"], new_w, new_b)
    return g.call_function(producer.target, args)


def _producer(m: Match):
    """The conv or linear the BatchNorm reads."""
    return m.node("conv") or m.node("linear")


def _describe(m: Match) -> str:
    return f"batch norm folded into {_producer(m).name}"


RULES = (
    Rule("batch norm folded", conv_batch_norm_pattern, _folded, (has_running_statistics,), describe=_describe),
    Rule("batch norm folded", linear_batch_norm_pattern, _folded, (has_running_statistics,), describe=_describe),
)


class FoldBatchNorm(RulePass):
    name = "fold_batch_norm"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})
    rules = RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        # BatchNorm in training normalises by batch statistics: nothing to fold
        return "training: BatchNorm uses batch statistics" if ctx.training else None


register_pass(FoldBatchNorm())
