"""reuse_linear_output: on CPU, a Linear whose output is 8 MiB or more (most often the LM
head's logits) written into a buffer kept between calls.

A rule table (``rewriter.rules``; ``w`` 2-D (out, in), ``b`` 1-D (out,) or absent)::

    F.linear(x, w, b)   ->  kept_linear(x, w, b)        (x.numel() / in * out * itemsize >= 8 MiB)
    F.linear(x, w)      ->  kept_linear(x, w)

glibc maps a block above its largest adaptive mmap threshold (32 MiB on 64-bit) afresh at every
allocation, and the kernel zeroes each page at first touch; the logits of a language model are
such a block at every step (1024 tokens x 32 000 words in fp32: 131 MB, 32 000 pages). A
smaller block comes from the heap, on fresh pages too wherever the step left the heap trimmed
(a training step frees its activations at the end of backward): 1024 tokens x 8000 words in
fp32 is 31.25 MiB, just under the ceiling, and LLaMA's LM head took 61-86 ms a step on the pages
its step mapped afresh, 26 ms where it mapped none (2-core AMD EPYC, one process, 6 profiled
steps, each mapping 12 000-13 500 fresh pages but the first; ``FLOOR``). The gate times a
region from a trimmed heap where the step maps fresh pages (rewriter.decide.fresh_heap), as it
runs otherwise, and keeps it where the pages show (in training timing the forward only:
the backward is F.linear's, the same in both forms); where the step maps few (under 5000 in each
of up to three warm runs) it is not tried at all (``saves_fresh_pages_only``). One
[1024, 32 000] fp32 matmul output, 2-core Xeon without AMX (``.diag/logits_buf.py``): 76 ms on
fresh pages, 53 ms on kept ones. ``kept_linear`` runs the GEMM F.linear runs (``addmm``/``mm``
with ``out=``) into a buffer of :mod:`rewriter.devices.kept_buffers`: two per dtype, since the
caller's previous output (last step's ``out.logits``) is still alive during the next forward,
each handed out again only when nothing else holds its storage (the caller, a view, a graph
that saved it). Backward is F.linear's: ``grad @ w``, ``grad.T @ x``, ``grad.sum(0)`` from the
saved input and weight. What is kept is two outputs' worth of memory between steps, what a
caching allocator keeps; :func:`release_buffers` frees them. With freed host memory kept by
the process (``rewriter.keep_freed_host_memory()``) there is nothing left to save, and the
gate measures that.

Safe when: CPU; ``w`` 2-D of ``x``'s width and floating dtype, ``b`` 1-D of ``w``'s rows (or
absent); the output at least ``FLOOR`` (8 MiB, 2048 pages: 1.4-10 ms of page faults at the 0.7-5 us a
page measured on these machines; a smaller output saves less than its measurement costs). Under
torch.compile the function runs F.linear (the buffer is the compiler's to plan): under a kept
regional compile a graph outside the blocks stays eager only where it runs a set-aside rewrite
(rewriter.decide.set_aside; an LM head with fuse_cross_entropy kept), so where the head graph
is compiled this rewrite saves nothing there, its row still "kept" (the compile's figure is
measured with it in place).
Contract: exact (the same GEMM, the same backward GEMMs).
Devices: cpu.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from rewriter.devices.kept_buffers import MMAP_CEILING, KeptBuffers, can_keep
from rewriter.pass_api import register_pass
from rewriter.rules import Match, Rule, RulePass, linear_in_out

# the smallest output rewritten: a quarter of glibc's largest mmap threshold, so a language
# model's logits just under it (1024 x 8000 fp32: 31.25 MiB; bf16: 15.6 MiB) are candidates,
# and a transformer block's own outputs at these sizes (1024 x 704 fp32: 2.75 MiB) are not
FLOOR = MMAP_CEILING // 4

# two per dtype: the output a caller still holds from the step before, and this step's
_OUTPUTS = KeptBuffers(slots=2)


class _KeptLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _into_kept(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g.mm(weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = g.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb


def _into_kept(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = _OUTPUTS.take((*x.shape[:-1], weight.shape[0]), x.dtype, x.device)
    rows = out.view(-1, weight.shape[0])  # written through; ``out`` itself is not a view
    x2 = x.reshape(-1, x.shape[-1])
    if bias is None:
        torch.mm(x2, weight.t(), out=rows)
    else:
        torch.addmm(bias, x2, weight.t(), out=rows)
    return out


def kept_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, its output in a buffer kept between calls (CPU)."""
    if not can_keep(x.device):
        return F.linear(x, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    return _KeptLinear.apply(x, weight, bias) if needs_grad else _into_kept(x, weight, bias)


def release_buffers() -> None:
    """Free the outputs kept between calls (each once its last holder lets go)."""
    _OUTPUTS.clear()


def linear_bias_pattern(x, w, b):
    return F.linear(x, w, b)


def linear_pattern(x, w):
    return F.linear(x, w)


def output_bytes(m: Match) -> int:
    """The output's bytes, of a match ``is_large_linear`` has checked the shapes of."""
    xi, wi = m.info("x"), m.info("w")
    return math.prod(xi.shape[:-1]) * wi.shape[0] * xi.dtype.itemsize


def is_large_linear(m: Match) -> bool:
    """A floating ``x`` of ``w``'s width and dtype (a ``b`` of its rows), output >= ``FLOOR``."""
    if linear_in_out(m) is None:
        return False
    xi, wi = m.info("x"), m.info("w")
    if xi.dtype != wi.dtype or not xi.dtype.is_floating_point:
        return False
    if "b" in m.values and m.info("b").dtype != wi.dtype:
        return False
    return output_bytes(m) >= FLOOR


def _kept(g, m: Match, ctx):
    return g.call_function(kept_linear, (m["x"], m["w"]) + ((m["b"],) if "b" in m.values else ()))


def _describe(m: Match) -> str:
    out, inp = m.info("w").shape
    return f"linear {inp}->{out}, {output_bytes(m) / 2**20:.0f} MiB out"


RULES = (  # with the bias first: it claims the call before the bare rule can
    Rule("kept_linear", linear_bias_pattern, _kept, (is_large_linear,), describe=_describe),
    Rule("kept_linear", linear_pattern, _kept, (is_large_linear,), describe=_describe),
)


class ReuseLinearOutput(RulePass):
    name = "reuse_linear_output"
    contract = "exact"
    devices = frozenset({"cpu"})
    rules = RULES
    # the GEMM stays: fresh pages are about a third of it (76 ms -> 53 ms above), so a short
    # run's budget goes to passes that can save more of their regions first
    saves_at_most = 0.35
    saves_fresh_pages_only = True  # not tried where the step maps few (its regions would show nothing)
    same_backward = True  # F.linear's backward GEMMs: its regions are timed forward only


register_pass(ReuseLinearOutput())
