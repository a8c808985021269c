"""fold_output_scale: a Linear's output scaled by a number, the scale moved to the Linear's input.

A rule table (``rewriter.rules``; ``w`` 2-D (out, in) with ``out > in``, ``b`` 1-D (out,) or
absent, ``c`` a number known when the graph is captured)::

    F.linear(x, w, b) * c   ->  F.linear(x * c, w, b * c)      (c * F.linear(...) alike)
    F.linear(x, w) * c      ->  F.linear(x * c, w)
    F.linear(x, w, b) / c   ->  F.linear(x / c, w, b / c)
    F.linear(x, w) / c      ->  F.linear(x / c, w)
    c == 1                  ->  the Linear alone

A language model that scales its logits (Granite's ``logits / logits_scaling``, Cohere's
``logits * logit_scale``) passes over the [tokens, vocab] logits once more in forward and once
in backward, to scale what could have been scaled as [tokens, hidden]: 1024 tokens x 8000 words
against 256 wide is 31 times the bytes, and the scaled copy is a fresh [tokens, vocab] block
(fresh pages on CPU, rewriter.devices.kept_buffers). The scalar goes to the GEMM's smaller
operand instead; with it gone, the head is a bare ``F.linear`` that ``reuse_linear_output`` and
``fuse_linear_cross_entropy`` can take. Granite's fp32 head region, 2-core AMD EPYC: 1.14x.

Safe when: ``c`` a finite, non-zero number (a literal, a constant 0-d tensor, a scalar computed
from shapes), not a tensor the step computes; the output wider than the input (elsewhere moving
the scale saves nothing); no cast between the Linear and the scale (it would move the scale into
another precision); a plain division (no ``rounding_mode``) and no ``out=``; not the division of
Gemma-2's logit cap ``c * tanh(z / c)`` (left whole for ``fuse_linear_cross_entropy``).
Contract: exact (scaling by a power of two, 1 included, commutes with the GEMM exactly; any other
number moves one rounding: fp32 rounding differences only).
Devices: cpu, cuda, npu (an elementwise scale and F.linear on all three).
"""
from __future__ import annotations

import math
import operator

import torch.nn.functional as F

from rewriter.capture.ir import is_op, tensor_info
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass, linear_in_out


def mul_bias_pattern(x, w, b, c):
    return F.linear(x, w, b) * c


def mul_pattern(x, w, c):
    return F.linear(x, w) * c


def div_bias_pattern(x, w, b, c):
    return F.linear(x, w, b) / c


def div_pattern(x, w, c):
    return F.linear(x, w) / c


def is_widening_linear(m: Match) -> bool:
    """A 2-D weight of ``x``'s width with more outputs than inputs, a bias of its outputs, and
    the scale computed in the Linear's own dtype (no cast looked through between them)."""
    io, out, lin = linear_in_out(m), tensor_info(m.root), tensor_info(m.node("linear"))
    if io is None or out is None or lin is None or io[1] <= io[0] or out.dtype != lin.dtype:
        return False
    return not (any(m.root.kwargs.get(k) is not None for k in ("rounding_mode", "out"))
                or len(m.root.args) > 2)


def is_number_scale(m: Match) -> bool:
    """``c`` is a number fixed at capture (a tensor the step computes, SwiGLU's ``silu(g) * up(x)``,
    is not a scale)."""
    return m.number("c") is not None


def is_not_a_softcap(m: Match) -> bool:
    """Not Gemma-2's ``c * tanh(z / c)``: fuse_linear_cross_entropy takes the head with its cap
    whole (the fold would leave it ``tanh(F.linear(x / c, w))``, a form it does not match)."""
    return not any(is_op(u, "tanh") for u in m.root.users)


def can_fold_scale(m: Match, ctx: PassContext) -> str | None:
    c = m.number("c")
    if c == 0.0 or not math.isfinite(c):
        return f"the scale is {c}: not folded (inf and nan would not propagate alike)"
    return None


def _folded(op):
    def replacement(g, m: Match, ctx):
        if m.number("c") == 1.0:  # x * 1 and x / 1 are x, exactly
            scaled = (m["x"],) + ((m["b"],) if "b" in m.values else ())
        else:  # the original scale argument (a number or its 0-d tensor), so dtypes behave alike
            scaled = tuple(g.call_function(op, (m[k], m["c"])) for k in ("x", "b") if k in m.values)
        return g.call_function(F.linear, (scaled[0], m["w"]) + scaled[1:])
    return replacement


def _describe(m: Match) -> str:
    out, inp = m.info("w").shape
    return f"linear {inp}->{out} {'/' if m.rule.pattern in (div_pattern, div_bias_pattern) else '*'} {m.number('c'):g}"


def _rule(pattern, op) -> Rule:
    """One row of the table: every form shares the conditions, the check and the description."""
    return Rule("scaled_linear", pattern, _folded(op), (is_number_scale, is_widening_linear, is_not_a_softcap),
                (can_fold_scale,), _describe)


RULES = (  # with the bias first: it claims the call before the bare rule can
    _rule(mul_bias_pattern, operator.mul),
    _rule(mul_pattern, operator.mul),
    _rule(div_bias_pattern, operator.truediv),
    _rule(div_pattern, operator.truediv),
)


class FoldOutputScale(RulePass):
    name = "fold_output_scale"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})
    rules = RULES
    saves_at_most = 0.5  # the GEMMs stay; the scale's passes over the wide output go


register_pass(FoldOutputScale())
