"""onednn_linear: an fp32 ``F.linear`` on CPU run by oneDNN instead of MKL, its backward too.

A rule table (``rewriter.rules``; ``w`` 2-D (out, in), ``v`` 2-D (in, out), ``b`` 1-D (out,))::

    F.linear(x, w, b)       ->  onednn_linear.linear(x, w, b)       (x, w, v, b fp32)
    F.linear(x, w)          ->  onednn_linear.linear(x, w)
    torch.addmm(b, x, v)    ->  onednn_linear.linear(x, v.t(), b)   (GPT-2's Conv1D; beta = alpha = 1)
    torch.matmul(x, v)      ->  onednn_linear.linear(x, v.t())      (x @ v; torch.mm alike)

Stock torch hands an fp32 linear on CPU to MKL's sgemm, which chooses its kernels by the CPU it
finds. On a 2-core AMD EPYC with AVX-512 (family 26, torch 2.13) that sgemm runs at ~200
GFLOP/s and oneDNN's fp32 matmul at ~400 (``.diag/gemm_dnn.py``): the fp32 training step of a
4-layer LLaMA (hidden 256, 4 x 256 tokens), every linear through oneDNN, 1.33x eager and 1.27x
compiled, side by side (``.diag/dnn_step.py``). Where MKL is at home (an Intel Xeon) the two
may be level and the gate does not keep it. The three GEMMs are custom ops
(:mod:`rewriter.devices.onednn_linear`), so a compile of the rewritten graph keeps them; the
compiler cannot make this rewrite itself, so a regional compile keeps it too.

Safe when: CPU, oneDNN in the build and enabled; ``x``, the weight (and ``b``) fp32, the weight
2-D of ``x``'s width, ``b`` of its outputs. At run time anything else (bf16 under autocast or after
``cast_to_half``, an empty batch) is F.linear, unchanged.
Contract: exact (the same products, summed in oneDNN's order: fp32 rounding differences).
Devices: cpu.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rewriter.devices.onednn_linear import linear, unavailable
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass, linear_in_out


def linear_bias_pattern(x, w, b):
    return F.linear(x, w, b)


def linear_pattern(x, w):
    return F.linear(x, w)


def addmm_pattern(x, v, b):
    return torch.addmm(b, x, v)


def matmul_pattern(x, v):
    return torch.matmul(x, v)


def mm_pattern(x, v):
    return torch.mm(x, v)


def _weight(m: Match) -> str:
    """The match's weight wildcard: ``w`` (out, in), as F.linear takes it, or ``v`` (in, out)."""
    return "w" if "w" in m.values else "v"


def is_fp32_linear(m: Match) -> bool:
    """fp32 ``x`` of the weight's input width, the weight 2-D, ``b`` (if any) fp32 of its outputs."""
    if linear_in_out(m, _weight(m)) is None:
        return False
    if m.info("x").dtype != torch.float32 or m.info(_weight(m)).dtype != torch.float32:
        return False
    return "b" not in m.values or m.info("b").dtype == torch.float32


def _onednn(g, m: Match, ctx):
    weight = m["w"] if _weight(m) == "w" else g.call_method("t", (m["v"],))
    return g.call_function(linear, (m["x"], weight) + ((m["b"],) if "b" in m.values else ()))


def _describe(m: Match) -> str:
    inp, out = linear_in_out(m, _weight(m))
    return f"linear {inp}->{out}"


RULES = (  # with the bias first: it claims the call before the bare rule can
    Rule("onednn_linear", linear_bias_pattern, _onednn, (is_fp32_linear,), describe=_describe),
    Rule("onednn_linear", linear_pattern, _onednn, (is_fp32_linear,), describe=_describe),
    Rule("onednn_linear", addmm_pattern, _onednn, (is_fp32_linear,), describe=_describe),
    Rule("onednn_linear", matmul_pattern, _onednn, (is_fp32_linear,), describe=_describe),
    Rule("onednn_linear", mm_pattern, _onednn, (is_fp32_linear,), describe=_describe),
)


class OneDnnLinear(RulePass):
    name = "onednn_linear"
    contract = "exact"
    devices = frozenset({"cpu"})
    rules = RULES
    # the GEMM stays, in another library: half of it at most (the EPYC above: ~2x)
    saves_at_most = 0.5
    full_precision_only = True  # under cast_to_half its linears are half: F.linear at run time

    def applies_to(self, ctx: PassContext) -> str | None:
        return super().applies_to(ctx) or unavailable()


register_pass(OneDnnLinear())
