"""Reach of fuse_attention: PyTorch Inductor's sfdp forms and ten transformers families.

The sfdp table is built from torch's own ``_sfdp_pattern_<n>`` functions and the example inputs
``_get_sfdp_patterns()`` gives them (``tests/sfdp_forms.py``). Each form: fired (site count),
outputs and gradients equal to the original. Forms 7-10 hard-code ``.to(torch.float16)`` of the
probabilities: they are run in float16 (what they are written for); in float32 the probabilities
reach p @ v as float16, which SDPA cannot express, and the pass declines with that reason.
"""
from __future__ import annotations

import sys

import pytest
import torch

from rewriter.capture.front_ends import capture
from rewriter.capture.ir import copy_graph_module
from rewriter.devices.backends import CpuBackend, NpuBackend
from rewriter.pass_api import PassContext, registered_passes
from tests import npu_shim
from tests.factories.families import family_capture
from tests.helpers import code, outputs_and_grads, rewrite
from tests.sfdp_forms import FORMS, sfdp_form

_HALF_FORMS = (7, 8, 9, 10)
# the 0-d tensor scale as a buffer and as an input, on the forms that spell the scale differently
_TENSOR_SCALE_FORMS = (1, 2, 14, 15, 28)
CASES = [(n, None if FORMS[n][1] is None else "float") for n in FORMS] + \
    [(n, kind) for n in _TENSOR_SCALE_FORMS for kind in ("tensor", "input")]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _form(n, scale_as, dtype=None, dropout_p=0.0):
    torch._dynamo.reset()  # one capture per form: stay under Dynamo's recompile limit
    model, args = sfdp_form(n, scale_as, dropout_p)
    dtype = dtype or (torch.float16 if n in _HALF_FORMS else torch.float32)
    return model, tuple(a.to(dtype) if a.is_floating_point() else a for a in args), dtype


def _same(model, cap, args, dtype):
    want_out, want_grad = outputs_and_grads(model, args, [])
    got_out, got_grad = outputs_and_grads(cap, args, [])
    assert len(got_grad) == len(want_grad) > 0
    for g, w in zip(got_out + got_grad, want_out + want_grad):
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("n,scale_as", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_sfdp_form_is_rewritten_with_equal_outputs_and_grads(n, scale_as):
    model, args, dtype = _form(n, scale_as)
    cap, sites = rewrite(model, args, "fuse_attention", front_end="dynamo", training=True)
    assert len(sites) == 1, f"form {n} ({scale_as}) not found"
    assert "scaled_dot_product_attention" in code(cap) and "softmax" not in code(cap)
    _same(model, cap, args, dtype)


def test_the_table_holds_all_30_forms():
    assert sorted(n for n, _ in CASES if _ in (None, "float")) == list(range(1, 31))


@pytest.mark.parametrize("n", _HALF_FORMS)
def test_sfdp_float16_probabilities_of_float32_q_are_declined_with_the_reason(n):
    model, args, _ = _form(n, "float", torch.float32)
    cap = capture(model, args, {}, "dynamo")
    cap(*args)
    ctx = PassContext(CpuBackend(), True)
    sites = [s for slot in cap.slots
             for s in registered_passes()["fuse_attention"].find(copy_graph_module(slot.kept), ctx)]
    assert sites == [] and any("float16" in why for why in ctx.declined), ctx.declined


@pytest.mark.parametrize("n", [3, 6, 16, 17, 19, 25])
def test_sfdp_dropout_is_carried_into_the_fused_call_in_training(n):
    """The contract for dropout: the fused kernel draws its own mask with the same p."""
    model, args, _ = _form(n, "float" if FORMS[n][1] else None, dropout_p=0.113377)
    cap, sites = rewrite(model, args, "fuse_attention", front_end="dynamo", training=True)
    assert len(sites) == 1 and "dropout_p = 0.113377" in code(cap)


@pytest.mark.parametrize("n,scale_as,fused", [
    (18, "float", True),    # where(keep, s, finfo.min as a tensor): a boolean mask
    (15, "float", True),    # masked_fill(expand_as(scores), full((), -inf))
    (1, "input", True),     # a 0-d tensor scale, applied to q
    (24, None, False),      # an arbitrary additive mask would go in as pse (declined, §1.1)
    (13, None, False),      # 3-D q/k/v: npu_fusion_attention takes BNSD
    (5, "float", False),    # an additive mask: pse
])
def test_sfdp_forms_on_the_npu_shim(fake_torch_npu, n, scale_as, fused):
    model, args, dtype = _form(n, scale_as)
    cap, sites = rewrite(model, args, "fuse_attention", front_end="dynamo", training=True,
                         backend=NpuBackend())
    assert len(sites) == int(fused)
    if fused:
        assert "npu_fusion_attention" in code(cap)
        _same(model, cap, args, dtype)


# --- transformers families ---------------------------------------------------------------------
# Attention sites per family (2 layers each, eager attention), read from transformers 5.24's
# modeling code, and on the NPU shim (npu_fusion_attention, training).
FAMILY_ATTENTION = {
    # family: (CPU SDPA sites, NPU shim sites, where they come from)
    "llama": (2, 2, "eager_attention_forward, repeat_kv (GQA), causal mask"),
    "mistral": (2, 2, "eager_attention_forward, where(keep, 0, min) mask: boolean on the NPU"),
    "qwen3": (2, 2, "eager_attention_forward after q/k norms"),
    "gemma": (2, 2, "eager_attention_forward, one k/v head repeated"),
    "falcon": (2, 2, "scores /= sqrt(d) (itruediv); one-head multi-query k/v: expanded for SDPA, "
                     "native on the NPU"),
    "bloom": (2, 0, "alibi.baddbmm(q, k^T, beta, alpha), view (B*N, L, S) -> (B, N, L, S) and back; "
                    "NPU: alibi + mask would go in as pse, whose shapes the reference does not document"),
    "gptj": (2, 2, "eager_attention_forward: q and k cast to fp32 (no-op casts in an fp32 model)"),
    "gpt2": (2, 2, "eager_attention_forward"),
    "bert": (2, 2, "eager_attention_forward, no mask (no padding in the inputs)"),
    "t5": (6, 0, "encoder self 2, decoder self 2, cross 2: scores + position_bias + mask, two "
                 "additive terms combined into one; NPU: pse, as for bloom"),
}


def _family_sites(family: str, backend=None) -> tuple[list, PassContext]:
    """The sites found in the family's (cached, read-only) training capture, and the context."""
    cap, _, _ = family_capture(family, training=True)
    ctx = PassContext(backend or CpuBackend(), True)
    p = registered_passes()["fuse_attention"]
    return [site for slot in cap.slots for site in p.find(copy_graph_module(slot.kept), ctx)], ctx


@pytest.mark.parametrize("family", list(FAMILY_ATTENTION))
def test_family_attention_sites_are_found_and_rewrite_with_equal_outputs_and_grads(family):
    sites, ctx = _family_sites(family)
    assert len(sites) == FAMILY_ATTENTION[family][0], ctx.declined
    # 0 wrong rewrites: every slot runs its rewrite as a candidate (the cached capture's kept
    # graphs stay as they are), against the original model
    cap, model, kw = family_capture(family, training=True)
    params = list(model.parameters())
    ctx = PassContext(CpuBackend(), True)
    for slot in cap.slots:
        slot.try_pass(registered_passes()["fuse_attention"], ctx)
    assert sum(slot.candidate is not None for slot in cap.slots) >= 1
    switch = cap.slots[0].switch
    want_out, want_grad = outputs_and_grads(model, (), params, kw)
    switch.use_candidate = True
    try:
        got_out, got_grad = outputs_and_grads(cap, (), params, kw)
    finally:
        switch.use_candidate = False
        for slot in cap.slots:
            slot.reject()
    for g, w in zip(got_out + got_grad, want_out + want_grad):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILY_ATTENTION))
def test_family_attention_sites_on_the_npu_shim(family, monkeypatch):
    family_capture(family, training=True)  # built before the shim: accelerate probes torch_npu
    monkeypatch.setitem(sys.modules, "torch_npu", npu_shim.as_module())
    sites, ctx = _family_sites(family, NpuBackend())
    assert len(sites) == FAMILY_ATTENTION[family][1], ctx.declined
    if FAMILY_ATTENTION[family][1] == 0:
        assert ctx.declined and all("pse" in why for why in ctx.declined)
