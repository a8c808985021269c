"""Reach on real model code: ten transformers families from tiny configs (tests/factories/families.py),
the sites each pass finds against the count read from the modeling code, and the rewritten
models' outputs and gradients against the originals (0 wrong rewrites).

Expected counts (LAYERS = 2), from site-packages/transformers/models/<family>/modeling_<family>.py:
- RMSNorm: LLaMA/Mistral/Gemma 2 per layer (input, post-attention) + the final norm = 5; Qwen3
  also q_norm and k_norm per layer = 9; T5LayerNorm (squares an fp32 copy) on 2 encoder layers x 2,
  2 decoder layers x 3 and two final norms = 12; Falcon, BLOOM, GPT-J, GPT-2, BERT: nn.LayerNorm.
- GELU written out: GPT-2 and GPT-J ``gelu_new`` (NewGELUActivation) per MLP = 2; BLOOM
  ``bloom_gelu_forward`` (the factored tanh form) = 2, in the no-grad capture counted here: with
  gradients BLOOM runs it inside ``GeLUFunction``, a torch.autograd.Function, reported as such; T5 gated-gelu ``gelu_new`` on
  wi_0 per layer = 4; Falcon ``nn.GELU`` and BERT ``GELUActivation`` already call F.gelu = 0.
- SwiGLU (NPU): LLaMA/Mistral/Qwen3 ``down(silu(gate(x)) * up(x))`` per layer = 2.
- GeGLU (NPU): Gemma ``gelu_pytorch_tanh(gate(x)) * up(x)`` per layer = 2. T5's gated-gelu
  writes its GELU out, so it becomes GeGLU only once fuse_gelu has run (0 here, where each
  pass sees the captured graph).
Attention is counted elsewhere (fuse_attention has its own table).
"""
from __future__ import annotations

import sys

import pytest
import torch

from rewriter.capture.front_ends import capture
from rewriter.capture.ir import copy_graph_module
from rewriter.decide.verify import flatten_output
from rewriter.devices.backends import CpuBackend, NpuBackend
from rewriter.pass_api import PassContext, registered_passes
from tests import npu_shim
from tests.factories.families import FAMILIES, build, family_capture, family_sites
from tests.helpers import outputs_and_grads

# family -> pass -> expected sites; NPU-only passes are counted on the reference shim
EXPECTED = {
    "llama":   {"fuse_rms_norm": 5, "fuse_gelu": 0, "fuse_swiglu": 2, "fuse_geglu": 0},
    "mistral": {"fuse_rms_norm": 5, "fuse_gelu": 0, "fuse_swiglu": 2, "fuse_geglu": 0},
    "qwen3":   {"fuse_rms_norm": 9, "fuse_gelu": 0, "fuse_swiglu": 2, "fuse_geglu": 0},
    "gemma":   {"fuse_rms_norm": 5, "fuse_gelu": 0, "fuse_swiglu": 0, "fuse_geglu": 2},
    "falcon":  {"fuse_rms_norm": 0, "fuse_gelu": 0, "fuse_swiglu": 0, "fuse_geglu": 0},
    "bloom":   {"fuse_rms_norm": 0, "fuse_gelu": 2, "fuse_swiglu": 0, "fuse_geglu": 0},
    "gptj":    {"fuse_rms_norm": 0, "fuse_gelu": 2, "fuse_swiglu": 0, "fuse_geglu": 0},
    "gpt2":    {"fuse_rms_norm": 0, "fuse_gelu": 2, "fuse_swiglu": 0, "fuse_geglu": 0},
    "bert":    {"fuse_rms_norm": 0, "fuse_gelu": 0, "fuse_swiglu": 0, "fuse_geglu": 0},
    "t5":      {"fuse_rms_norm": 12, "fuse_gelu": 4, "fuse_swiglu": 0, "fuse_geglu": 0},
}
NPU_ONLY = {"fuse_swiglu", "fuse_geglu"}
assert set(EXPECTED) == set(FAMILIES)


@pytest.fixture
def shim(monkeypatch):
    """The reference shim as torch_npu, put in only after the family's modules are imported
    (accelerate, which transformers imports, asks importlib for torch_npu's spec)."""
    def put():
        monkeypatch.setitem(sys.modules, "torch_npu", npu_shim.as_module())
    return put


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_expressible_site_is_found(family, shim):
    family_capture(family)
    found = {p: len(family_sites(family, p)) for p in EXPECTED[family] if p not in NPU_ONLY}
    shim()
    found.update({p: len(family_sites(family, p, backend=NpuBackend())) for p in EXPECTED[family] if p in NPU_ONLY})
    assert found == EXPECTED[family]


# The families with sites, rewritten by every pass of the table at once on the NPU shim (whose
# ops are the documented formulas in plain torch), outputs and every gradient compared (BLOOM:
# outputs, captured without gradients, where its GELU is not inside an autograd.Function).
@pytest.mark.parametrize("family", sorted(f for f, row in EXPECTED.items() if any(row.values())))
def test_rewritten_families_keep_outputs_and_gradients(family, shim):
    model, kw = build(family)
    grads = family != "bloom"
    torch._dynamo.reset()
    cap = capture(model, (), kw, "dynamo")
    with torch.set_grad_enabled(grads):
        cap(**kw)
    shim()
    ctx = PassContext(NpuBackend(), False)
    passes = [registered_passes()[p] for p, n in EXPECTED[family].items() if n]
    sites = 0
    for slot in cap.slots:
        for p in passes:
            sites += len(slot.try_pass(p, ctx))
            slot.accept()
    assert sites == sum(EXPECTED[family].values())
    if not grads:
        with torch.no_grad():
            want, got = [t for _, t in flatten_output(model(**kw))], [t for _, t in flatten_output(cap(**kw))]
    else:
        params = list(model.parameters())
        (w_out, w_grads), (g_out, g_grads) = outputs_and_grads(model, (), params, kw), outputs_and_grads(cap, (), params, kw)
        want, got = w_out + w_grads, g_out + g_grads
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        # fp32: fused reductions reorder sums, so an element that cancels (a gradient summed over
        # layers) carries a few ulps of the terms it sums: the bound scales with the tensor's size
        scale = max(1.0, float(w.abs().max())) if w.numel() else 1.0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5 * scale)


def test_bloom_gelu_in_training_is_reported_inside_an_autograd_function():
    """BLOOM's training GELU is a torch.autograd.Function (its own backward): not rewritten, and
    the report says why."""
    cap, _, _ = family_capture("bloom", True)
    ctx = PassContext(CpuBackend(), True)
    sites = [s for slot in cap.slots for s in registered_passes()["fuse_gelu"].find(copy_graph_module(slot.kept), ctx)]
    assert sites == [] and any("inside an autograd.Function" in d for d in ctx.declined)
