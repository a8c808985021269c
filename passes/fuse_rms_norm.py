"""fuse_rms_norm: RMSNorm written out into one fused norm (a rule table, ``rewriter.rules``).

Rewrites (``x`` is the input, ``w`` of shape (D,), products in any order)::

    x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)           -> F.rms_norm(x, (D,), None, eps)
    w * (that)              (no cast between, or a no-op one)  -> F.rms_norm(x, (D,), w, eps)
    (that) * (1 + w)        (Gemma: the weight is an offset)   -> F.rms_norm(x, (D,), 1 + w, eps)
    w * (that).to(half)     (LLaMA/Qwen: cast before weight)   -> w * F.rms_norm(x, (D,), None, eps).to(half)
  NPU: torch_npu.npu_rms_norm(x, w, eps)[0] (reference npu_ecosystem.md §1.3).

The casts models write around it are looked through (``rewriter.rules`` optional links): LLaMA
and Qwen norm ``x.to(float32)``; T5 squares an fp32 copy but scales the original ``x``, which
is the same norm computed in fp32 (``x * rsqrt(v)`` promotes ``x``), so the fused norm is fed
``x`` cast to the dtype the model's expression computed in.

Safe when: the square, mean, add, rsqrt feed only each other; the mean is over the last dim
with keepdim; ``eps`` is a number; ``w`` is 1-D of the normalised size.
Contract: exact (one reduction instead of several: fp32 rounding only). The NPU form is used
only without a real dtype cast between the norm and the weight (npu_rms_norm computes
internally, so it cannot cast before the weight as HF does; reference §1.3 caveat).
NPU (§1.3): without a weight the stand-in gamma is ``x.new_ones(D)`` (x's device and dtype:
a documented pair on every chip); a weight of another dtype than x is declined (the op returns
x's dtype where PyTorch promotes), as are pairs a chip does not list (bf16 on Atlas
training/310P) and, on 310P, a tail axis under 32 bytes.
Devices: cpu, cuda, npu.
"""
from __future__ import annotations

import dataclasses
import operator

import torch

from rewriter.capture.ir import is_cast, is_noop_cast, tensor_info
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass, cast_to


def rms_norm_pattern(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def weighted_rms_norm_pattern(x, eps, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def offset_rms_norm_pattern(x, eps, w):  # Gemma: weight stored as w - 1
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _dtype(m: Match) -> torch.dtype:
    """The dtype the norm computes in: ``x * rsqrt(v)`` promotes (T5's bf16 ``x`` with an fp32
    ``v`` is an fp32 norm)."""
    return torch.promote_types(m.info("x").dtype, tensor_info(m.node("rsqrt")).dtype)


def _dim(m: Match) -> int:
    return m.info("x").shape[-1]


def is_norm(m: Match) -> bool:
    return m.info("x") is not None and m.number("eps") is not None and tensor_info(m.node("rsqrt")) is not None


def has_weight_of_norm_size(m: Match) -> bool:
    w = m.info("w")
    return is_norm(m) and w is not None and w.shape == (_dim(m),)


def can_fuse(m: Match, ctx: PassContext) -> str | None:
    x = dataclasses.replace(m.info("x"), dtype=_dtype(m))
    return ctx.backend.cannot_rms_norm(x, m.info("w").dtype if "w" in m.values else None)


def can_fuse_before_cast(m: Match, ctx: PassContext) -> str | None:
    users = list(m.root.users)
    if ctx.backend.name == "npu" and len(users) == 1 and is_cast(users[0]) and not is_noop_cast(users[0]):
        return "npu_rms_norm cannot cast between the norm and the weight as this model does (§1.3)"
    return can_fuse(m, ctx)


def _emit(g, m: Match, ctx: PassContext, weight):
    x = cast_to(g, m["x"], _dtype(m))
    return ctx.backend.emit_rms_norm(g, x, weight, m.number("eps"), _dim(m))


def _describe(folded: str):
    return lambda m: f"rms_norm over {_dim(m)}, eps {m.number('eps'):g}{folded}"


# Widest first: Gemma's (1 + w) is also a weight, but named as what the model wrote.
RULES = (
    Rule("rms_norm, offset weight folded", offset_rms_norm_pattern,
         lambda g, m, ctx: _emit(g, m, ctx, g.call_function(operator.add, (1.0, m["w"]))),
         (has_weight_of_norm_size,), (can_fuse,), _describe(", weight (1 + w) folded")),
    Rule("rms_norm, weight folded", weighted_rms_norm_pattern, lambda g, m, ctx: _emit(g, m, ctx, m["w"]),
         (has_weight_of_norm_size,), (can_fuse,), _describe(", weight folded")),
    Rule("rms_norm", rms_norm_pattern, lambda g, m, ctx: _emit(g, m, ctx, None),
         (is_norm,), (can_fuse_before_cast,), _describe("")),
)


class FuseRmsNorm(RulePass):
    name = "fuse_rms_norm"
    contract = "exact"
    fused_kind = "rms_norm"
    devices = frozenset({"cpu", "cuda", "npu"})
    version = 2  # T5's and Gemma's forms
    rules = RULES

    def cannot_find(self, ctx: PassContext) -> str | None:
        return ctx.backend.cannot_offer("rms_norm")


register_pass(FuseRmsNorm())
