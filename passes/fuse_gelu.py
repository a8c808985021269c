"""fuse_gelu: GELU written out into one activation (a rule table, ``rewriter.rules``).

Rewrites::

    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))   -> F.gelu(x, approximate="tanh")
        (transformers' gelu_new / NewGELUActivation)
    0.5 * x * (1 + tanh(sqrt(2/pi) * x * (1 + 0.044715 * x*x))) -> the same (factored: gelu_fast,
        BLOOM's bloom_gelu_forward; x*(1 + c*x*x) = x + c*x**3)
    0.5 * x * (1 + erf(x / sqrt(2)))                            -> F.gelu(x)  (erf GELU, exact)
    x * sigmoid(1.702 * x)                                      -> NPU: torch_npu.npu_fast_gelu(x)
        (quick GELU; only with optimize(dtype=...): npu_fast_gelu's formula differs by SoC,
         reference npu_ecosystem.md §1.8, so it is treated as an approximation)
  NPU, tanh form: torch_npu.npu_gelu(x, approximate="tanh") (native F.gelu on NPU ignores
  ``approximate``, §1.8); erf form: F.gelu(x) (the erf GELU native F.gelu computes).

Safe when: every intermediate feeds only the next step and the constants match the formula
(to 1e-6 relative; products and sums in any order, ``x/2`` for ``0.5*x``).
Contract: exact for the tanh and erf forms; the quick-GELU rewrite is an approximation, done
only when the user opted into reduced precision.
Devices: cpu, cuda (tanh, erf forms), npu (all).
BLOOM in training computes its GELU in a ``torch.autograd.Function`` (its own backward): that
site is reported "inside an autograd.Function", not rewritten.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass

_C = math.sqrt(2.0 / math.pi)


def gelu_tanh_pattern(x):
    return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_factored_pattern(x):
    return 0.5 * x * (1.0 + torch.tanh(_C * x * (1.0 + 0.044715 * x * x)))


def gelu_erf_pattern(x):
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def quick_gelu_pattern(x):
    return x * torch.sigmoid(1.702 * x)


def _is_tensor(m: Match) -> bool:
    return m.info("x") is not None


def can_fuse_tanh(m: Match, ctx: PassContext) -> str | None:
    return ctx.backend.cannot_offer("gelu_tanh") or ctx.backend.cannot_take("gelu_tanh", m.info("x").dtype)


def can_fuse_quick(m: Match, ctx: PassContext) -> str | None:
    return ctx.backend.cannot_offer("quick_gelu") or ctx.backend.cannot_take("quick_gelu", m.info("x").dtype)


def _tanh(g, m, ctx):
    return ctx.backend.emit_gelu_tanh(g, m["x"])


RULES = (
    Rule("gelu (tanh)", gelu_tanh_pattern, _tanh, (_is_tensor,), (can_fuse_tanh,)),
    Rule("gelu (tanh, factored)", gelu_tanh_factored_pattern, _tanh, (_is_tensor,), (can_fuse_tanh,)),
    Rule("gelu (erf)", gelu_erf_pattern, lambda g, m, ctx: g.call_function(F.gelu, (m["x"],)), (_is_tensor,)),
    Rule("gelu (quick)", quick_gelu_pattern, lambda g, m, ctx: ctx.backend.emit_quick_gelu(g, m["x"]),
         (_is_tensor,), (can_fuse_quick,)),
)


class FuseGelu(RulePass):
    name = "fuse_gelu"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})
    version = 2  # the erf and factored tanh forms
    rules = RULES

    def applies_to(self, ctx: PassContext) -> str | None:
        why = super().applies_to(ctx)
        if why is None:
            # Where neither npu_gelu nor a quick form is offered (an NPU chip or torch_npu the
            # docs do not list), the pass is not applicable: the erf form alone is left to it.
            tanh = ctx.backend.cannot_offer("gelu_tanh")
            quick = ctx.backend.cannot_offer("quick_gelu") if ctx.dtype is not None else \
                "quick GELU is an approximation, fused only with optimize(dtype=...)"
            if tanh and quick:
                why = f"{tanh}; {quick}"
        return why

    def active_rules(self, ctx: PassContext) -> tuple[Rule, ...]:
        # quick GELU is an approximation: only with dtype=, and only where a fused form exists;
        # otherwise it is not a site (nothing to decline: it is left as written).
        return RULES if ctx.dtype is not None and ctx.backend.offers("quick_gelu") else RULES[:-1]


register_pass(FuseGelu())
