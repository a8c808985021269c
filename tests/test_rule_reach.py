"""Reach of the rule tables: the forms real model code writes (transformers' gelu_fast, BLOOM,
the erf GELU, T5's and Gemma's RMSNorm, GeGLU/SwiGLU from two projections). Each form: it
fires, keeps outputs and gradients, declines where it must, and its NPU form runs on the shim."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rewriter.devices.backends import NpuBackend
from tests.helpers import code, outputs_and_grads, rewrite


def _same(model, cap, args, **tol):
    params = list(model.parameters())
    want, got = outputs_and_grads(model, args, params), outputs_and_grads(cap, args, params)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, **tol)


# --- GELU ----------------------------------------------------------------------------------------

class Act(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def erf_gelu(x):  # transformers' old gelu / BERT's
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_fast(x):  # transformers.activations.FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def bloom_gelu(x):  # transformers.models.bloom.modeling_bloom.bloom_gelu_forward
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("fn, approximate", [(erf_gelu, "none"), (gelu_fast, "tanh"), (bloom_gelu, "tanh")],
                         ids=["erf", "gelu_fast", "bloom"])
def test_gelu_forms_fire_and_keep_numerics(fn, approximate, front_end):
    model, x = Act(fn), torch.randn(4, 64)
    cap, sites = rewrite(model, (x,), "fuse_gelu", front_end=front_end, training=True)
    assert len(sites) == 1 and "gelu" in code(cap) and "erf(" not in code(cap)
    assert code(cap).count("tanh") == (1 if approximate == "tanh" else 0)  # approximate = 'tanh' only
    _same(model, cap, (x,))


@pytest.mark.parametrize("fn", [
    lambda x: x * 0.5 * (1.0 + torch.erf(x / 2.0)),                                   # not x/sqrt(2)
    lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.04 * x * x))),  # 0.04
    lambda x: (lambda e: 0.5 * x * (1.0 + e) + e.sum())(torch.erf(x * 0.7071067811865476)),
], ids=["erf-scale", "tanh-constant", "reused-erf"])
def test_gelu_forms_decline(fn):
    assert rewrite(Act(fn), (torch.randn(8),), "fuse_gelu")[1] == []


@pytest.mark.parametrize("fn, op", [(erf_gelu, "gelu"), (gelu_fast, "npu_gelu")], ids=["erf", "gelu_fast"])
def test_gelu_forms_on_npu_shim(fake_torch_npu, fn, op):
    model, x = Act(fn), torch.randn(4, 32)
    cap, sites = rewrite(model, (x,), "fuse_gelu", training=True, backend=NpuBackend())
    assert len(sites) == 1 and op in code(cap)
    _same(model, cap, (x,))


# --- RMSNorm -------------------------------------------------------------------------------------

class T5Norm(nn.Module):
    """transformers' T5LayerNorm: squares an fp32 copy, scales the original x."""

    def __init__(self, d=32, eps=1e-6, half=False):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.randn(d)), eps
        self.half = half  # T5 tests self.weight.dtype, which symbolic_trace cannot read

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.half:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class GemmaNorm(nn.Module):
    """transformers' Gemma RMSNorm: the weight is an offset, (1 + w)."""

    def __init__(self, d=32, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.randn(d) * 0.1), eps

    def forward(self, x):
        output = x.float()
        output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("cls, folded", [(T5Norm, "weight folded"), (GemmaNorm, "(1 + w) folded")],
                         ids=["t5", "gemma"])
def test_rms_norm_forms_fire_and_keep_numerics(cls, folded, front_end):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(2, 8, 32)
    cap, sites = rewrite(model, (x,), "fuse_rms_norm", front_end=front_end, training=True)
    assert len(sites) == 1 and folded in sites[0].description
    assert "rms_norm" in code(cap) and "rsqrt" not in code(cap)
    _same(model, cap, (x,))


def test_t5_norm_in_bf16_computes_in_fp32_as_the_model_does():
    torch.manual_seed(0)
    model, x = T5Norm(half=True).to(torch.bfloat16), torch.randn(2, 8, 32, dtype=torch.bfloat16)
    cap, sites = rewrite(model, (x,), "fuse_rms_norm")
    # x * rsqrt(fp32 variance) is fp32; the weight multiplies after a cast back to bf16
    assert len(sites) == 1 and "weight folded" not in sites[0].description
    torch.testing.assert_close(cap(x), model(x))


@pytest.mark.parametrize("form", ["gemma-weight-2d", "t5-other-input"])
def test_rms_norm_forms_decline(form):
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 32))

        def forward(self, x, y):
            if form == "t5-other-input":  # squares y, scales x: not a norm of x
                return x * torch.rsqrt(y.to(torch.float32).pow(2).mean(-1, keepdim=True) + 1e-6)
            out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return out * (1.0 + self.weight)
    x, y = torch.randn(4, 32), torch.randn(4, 32)
    cap, sites = rewrite(Bad(), (x, y), "fuse_rms_norm")
    # the 2-D offset weight is not folded (the norm itself still is); the mixed form is no norm
    assert [("folded" in s.description) for s in sites] == ([False] if form == "gemma-weight-2d" else [])


def test_rms_norm_forms_on_npu_shim(fake_torch_npu):
    for model in (T5Norm(), GemmaNorm()):
        x = torch.randn(4, 32)
        cap, sites = rewrite(model, (x,), "fuse_rms_norm", training=True, backend=NpuBackend())
        assert len(sites) == 1 and "npu_rms_norm" in code(cap)
        _same(model, cap, (x,))


# --- GeGLU / SwiGLU from two projections ----------------------------------------------------------

class GatedMlp(nn.Module):
    """Gemma / LLaMA / T5-gated: act(gate(x)) * up(x), two projections."""

    def __init__(self, act="gelu", d=16, h=32, bias=False, up_bias=None):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=bias)
        self.up = nn.Linear(d, h, bias=bias if up_bias is None else up_bias)
        self.act = act

    def forward(self, x):
        a = self.gate(x)
        a = F.silu(a) if self.act == "silu" else F.gelu(a, approximate=self.act.split("-")[-1]
                                                           if "-" in self.act else "none")
        return a * self.up(x)


@pytest.mark.parametrize("act, op", [("gelu", "npu_geglu"), ("gelu-tanh", "npu_geglu"), ("silu", "npu_swiglu")])
@pytest.mark.parametrize("bias", [False, True])
def test_two_projections_merge_on_npu_shim(fake_torch_npu, act, op, bias):
    torch.manual_seed(0)
    model, x = GatedMlp(act, bias=bias), torch.randn(2, 5, 16)
    name = "fuse_swiglu" if act == "silu" else "fuse_geglu"
    cap, sites = rewrite(model, (x,), name, training=True, backend=NpuBackend())
    assert len(sites) == 1 and "merged" in sites[0].description and op in code(cap)
    assert code(cap).count("linear(") == 1 and "torch.cat" in code(cap)  # one GEMM, weights concatenated
    _same(model, cap, (x,))
    with torch.no_grad():  # the model's own parameters are used, not copies
        model.gate.weight.mul_(2)
    torch.testing.assert_close(cap(x), model(x))


def test_geglu_halves_follow_the_recorded_formula(fake_torch_npu):
    """npu_geglu(..., activate_left=False) activates the second half (§1.7, the shim's formula):
    the gate weight must go second. Swapping the halves would change the result."""
    import torch_npu
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(torch_npu.npu_geglu(x, -1, 0, False)[0], a * F.gelu(b))
    model, x = GatedMlp("gelu"), torch.randn(2, 16)
    cap, sites = rewrite(model, (x,), "fuse_geglu", backend=NpuBackend())
    cat = next(n for slot in cap.slots for n in slot.kept.graph.nodes if n.target is torch.cat)
    assert [str(w.target) for w in cat.args[0]] == ["up.weight", "gate.weight"]
    torch.testing.assert_close(cap(x), model(x))


@pytest.mark.parametrize("case", ["cpu", "mixed-bias", "other-input", "up-reused"])
def test_two_projections_decline(fake_torch_npu, case):
    torch.manual_seed(0)

    class Other(GatedMlp):
        def forward(self, x):
            if case == "other-input":
                return F.gelu(self.gate(x)) * self.up(x * 2)
            up = self.up(x)
            return F.gelu(self.gate(x)) * up + up
    model = GatedMlp(up_bias=True) if case == "mixed-bias" else (Other() if case != "cpu" else GatedMlp())
    backend = None if case == "cpu" else NpuBackend()
    cap, sites = rewrite(model, (torch.randn(2, 16),), "fuse_geglu", backend=backend)
    assert sites == []  # CPU: no fused GeGLU; otherwise not one merged projection pair


# --- rotary, rotate_half by chunk -------------------------------------------------------------------

class ChunkRotary(nn.Module):
    def forward(self, x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope(d=16):
    torch.manual_seed(0)
    angle = torch.randn(1, 1, 8, d // 2)
    emb = torch.cat((angle, angle), -1)
    return torch.randn(2, 4, 8, d), emb.cos(), emb.sin()


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_chunked_rotary_on_npu_shim(fake_torch_npu, front_end):
    model, args = ChunkRotary(), _rope()
    cap, sites = rewrite(model, args, "fuse_rotary_embedding", front_end=front_end, training=True,
                         backend=NpuBackend())
    assert len(sites) == 1 and "npu_rotary_mul" in code(cap) and "chunk" not in code(cap)
    _same(model, cap, args)


def test_chunked_rotary_declines_on_cpu_and_for_the_wrong_halves(fake_torch_npu):
    class Swapped(nn.Module):
        def forward(self, x, cos, sin):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x1, x2), dim=-1) * sin  # not rotate_half
    assert rewrite(ChunkRotary(), _rope(), "fuse_rotary_embedding")[1] == []
    assert rewrite(Swapped(), _rope(), "fuse_rotary_embedding", backend=NpuBackend())[1] == []


def test_geglu_after_fuse_qkv_projections_reorders_the_merged_weights(fake_torch_npu):
    """The pipeline merges gate/up first (fuse_qkv_projections: gelu(c[0]) * c[1] of one linear);
    the GeGLU rule rebuilds that merge up-half first, so activate_left=False applies (§1.7)."""
    from rewriter.capture.front_ends import capture
    from rewriter.pass_api import PassContext, registered_passes
    torch.manual_seed(0)
    for bias in (False, True):
        model, x = GatedMlp("gelu-tanh", bias=bias), torch.randn(2, 5, 16)
        cap = capture(model, (x,), {}, "fx")
        ctx = PassContext(NpuBackend(), True)
        for name in ("fuse_qkv_projections", "fuse_geglu"):
            sites = cap.slots[0].try_pass(registered_passes()[name], ctx)
            cap.slots[0].accept()
            assert len(sites) == 1
        assert "reordered" in sites[0].description and "npu_geglu" in code(cap)
        _same(model, cap, (x,))
    # gelu on the first half of a tensor nobody merged stays declined
    class Packed(nn.Module):
        def forward(self, h):
            a, b = h.chunk(2, -1)
            return F.gelu(a) * b
    assert rewrite(Packed(), (torch.randn(2, 16),), "fuse_geglu", backend=NpuBackend())[1] == []
