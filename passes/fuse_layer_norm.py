"""fuse_layer_norm: layer norm written out with mean and variance into ``F.layer_norm``.

A rule table (``rewriter.rules``), one rule per spelling of the variance, the root and the
affine part (over the last dim, ``w``/``b`` of shape (D,))::

    u = x.mean(-1, keepdim=True)
    v = (x - u).pow(2).mean(-1, keepdim=True)    # or x.var(-1, keepdim=True, unbiased=False / correction=0)
    y = (x - u) / torch.sqrt(v + eps)            # or (x - u) * torch.rsqrt(v + eps)
    w * y + b    (or w * y, y + b, y)            -> F.layer_norm(x, (D,), w, b, eps)

Declines ``(x - u) / (x.std(-1) + eps)``: the unbiased std and eps outside the root are a
different normalisation that ``F.layer_norm`` cannot express (no rule spells it).
Safe when: the intermediates feed only each other (``x - u`` may be computed twice), ``eps``
is a number, ``w``/``b`` are 1-D of the normalised size.
Contract: exact (two reductions become one Welford pass: fp32 rounding only).
Devices: cpu, cuda, npu (F.layer_norm everywhere; npu_layer_norm_eval is deprecated, §1.14).
"""
from __future__ import annotations

import itertools

import torch

from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass

# The biased variance of x over the last dim, three ways.
VARIANCES = {
    "pow": lambda x, u: (x - u).pow(2).mean(-1, keepdim=True),
    "var": lambda x, u: x.var(-1, keepdim=True, unbiased=False),  # = correction=0 (rules.py)
}
# (x - u) / sqrt(v + eps) = (x - u) * rsqrt(v + eps)
ROOTS = {
    "div": lambda d, v, eps: d / torch.sqrt(v + eps),
    "rsqrt": lambda d, v, eps: d * torch.rsqrt(v + eps),
}
AFFINES = {  # widest first: w * y + b claims its nodes before y alone can
    "w, b": lambda y, w, b: w * y + b,
    "w": lambda y, w, b: w * y,
    "b": lambda y, w, b: y + b,
    "": lambda y, w, b: y,
}


def _layer_norm_pattern(variance, root, affine):
    def layer_norm_pattern(x, eps, w, b):
        u = x.mean(-1, keepdim=True)
        return affine(root(x - u, variance(x, u), eps), w, b)
    return layer_norm_pattern


def _dim(m: Match) -> int:
    return m.info("x").shape[-1]


def is_layer_norm(m: Match) -> bool:
    if m.info("x") is None or m.number("eps") is None:
        return False
    return all(m.info(k) is not None and m.info(k).shape == (_dim(m),) for k in ("w", "b") if k in m.values)


def _emit(g, m: Match, ctx: PassContext):
    return ctx.backend.emit_layer_norm(g, m["x"], m.values.get("w"), m.values.get("b"), m.number("eps"), _dim(m))


RULES = tuple(
    Rule(f"layer_norm ({v}, {r}{', ' + a if a else ''})", _layer_norm_pattern(VARIANCES[v], ROOTS[r], AFFINES[a]),
         _emit, (is_layer_norm,), describe=lambda m: f"layer_norm over {_dim(m)}, eps {m.number('eps'):g}")
    for a, v, r in itertools.product(AFFINES, VARIANCES, ROOTS))


class FuseLayerNorm(RulePass):
    name = "fuse_layer_norm"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})
    rules = RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        return ctx.backend.cannot_offer("layer_norm")


register_pass(FuseLayerNorm())
