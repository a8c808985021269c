"""onednn_linear: an fp32 ``F.linear`` on CPU run by oneDNN instead of MKL, its backward too.

A rule table (``rewriter.rules``; ``w`` 2-D (out, in), ``b`` 1-D (out,) or absent)::

    F.linear(x, w, b)   ->  onednn_linear.linear(x, w, b)      (x, w, b fp32)
    F.linear(x, w)      ->  onednn_linear.linear(x, w)

Stock torch hands an fp32 linear on CPU to MKL's sgemm, which chooses its kernels by the CPU it
finds. On a 2-core AMD EPYC with AVX-512 (family 26, torch 2.13) that sgemm runs at ~200
GFLOP/s and oneDNN's fp32 matmul at ~400 (``.diag/gemm_dnn.py``): the fp32 training step of a
4-layer LLaMA (hidden 256, 4 x 256 tokens), every linear through oneDNN, 1.33x eager and 1.27x
compiled, side by side (``.diag/dnn_step.py``). Where MKL is at home (an Intel Xeon) the two
may be level and the gate does not keep it. The three GEMMs are custom ops
(:mod:`rewriter.devices.onednn_linear`), so a compile of the rewritten graph keeps them; the
compiler cannot make this rewrite itself, so a regional compile keeps it too.

Safe when: CPU, oneDNN in the build and enabled; ``x``, ``w`` (and ``b``) fp32, ``w`` 2-D of
``x``'s width, ``b`` of ``w``'s rows. At run time anything else (bf16 under autocast or after
``cast_to_half``, an empty batch) is F.linear, unchanged.
Contract: exact (the same products, summed in oneDNN's order: fp32 rounding differences).
Devices: cpu.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rewriter.devices.onednn_linear import linear, unavailable
from rewriter.pass_api import PassContext, register_pass
from rewriter.rules import Match, Rule, RulePass


def linear_bias_pattern(x, w, b):
    return F.linear(x, w, b)


def linear_pattern(x, w):
    return F.linear(x, w)


def is_fp32_linear(m: Match) -> bool:
    """fp32 ``x`` of ``w``'s width, ``w`` 2-D, ``b`` (if any) fp32 of ``w``'s rows."""
    xi, wi = m.info("x"), m.info("w")
    if xi is None or wi is None or xi.ndim < 1 or wi.ndim != 2 or xi.shape[-1] != wi.shape[1]:
        return False
    if xi.dtype != torch.float32 or wi.dtype != torch.float32:
        return False
    if "b" in m.values:
        b = m.info("b")
        return b is not None and b.shape == (wi.shape[0],) and b.dtype == torch.float32
    return True


def _onednn(g, m: Match, ctx):
    return g.call_function(linear, (m["x"], m["w"]) + ((m["b"],) if "b" in m.values else ()))


def _describe(m: Match) -> str:
    out, inp = m.info("w").shape
    return f"linear {inp}->{out}"


RULES = (  # with the bias first: it claims the call before the bare rule can
    Rule("onednn_linear", linear_bias_pattern, _onednn, (is_fp32_linear,), describe=_describe),
    Rule("onednn_linear", linear_pattern, _onednn, (is_fp32_linear,), describe=_describe),
)


class OneDnnLinear(RulePass):
    name = "onednn_linear"
    contract = "exact"
    devices = frozenset({"cpu"})
    rules = RULES
    # the GEMM stays, in another library: half of it at most (the EPYC above: ~2x)
    saves_at_most = 0.5

    def applies_to(self, ctx: PassContext) -> str | None:
        return super().applies_to(ctx) or unavailable()


register_pass(OneDnnLinear())
