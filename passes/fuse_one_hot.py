"""fuse_one_hot: a one-hot matrix multiplied by a weight into a gather (``F.embedding``).

A rule table (``rewriter.rules``; ``W`` of shape (n, d) for matmul, (d, n) for linear)::

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

import torch
import torch.nn.functional as F

from rewriter.pass_api import register_pass
from rewriter.rules import Match, Rule, RulePass


def one_hot_matmul_pattern(idx, n, dtype, w):
    return torch.matmul(F.one_hot(idx, n).to(dtype), w)


def one_hot_linear_pattern(idx, n, dtype, w, b):
    return F.linear(F.one_hot(idx, n).to(dtype), w, b)


def _classes_are(axis: int):
    def has_a_row_per_class(m: Match) -> bool:
        n, w = m["n"], m.info("w")
        return isinstance(n, int) and n >= 1 and w is not None and w.ndim == 2 and w.shape[axis] == n
    return has_a_row_per_class


def _gather(g, m: Match, ctx):
    return g.call_function(F.embedding, (m["idx"], m["w"]))


def _gather_transposed(g, m: Match, ctx):
    new = g.call_function(F.embedding, (m["idx"], g.call_function(torch.t, (m["w"],))))
    return new if m["b"] is None else g.call_function(operator.add, (new, m["b"]))


RULES = (
    Rule("one_hot @ weight -> embedding", one_hot_matmul_pattern, _gather, (_classes_are(0),)),
    Rule("one_hot @ weight -> embedding", one_hot_linear_pattern, _gather_transposed, (_classes_are(1),)),
)


class FuseOneHot(RulePass):
    name = "fuse_one_hot"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})
    rules = RULES


register_pass(FuseOneHot())
