"""The fused-op catalogue: each pass fires, keeps outputs and gradients, declines where it must,
and its NPU form matches the reference shim's documented semantics."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rewriter.devices.backends import NpuBackend
from tests.helpers import code, outputs_and_grads, rewrite

# --- small models, one pattern each --------------------------------------------------------------

class HfRmsNorm(nn.Module):
    """LLaMA's RMSNorm: fp32 upcast, cast back before the weight."""

    def __init__(self, d=32):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class LayerNormByHand(nn.Module):
    def __init__(self, d=32, variant="div"):
        super().__init__()
        self.w, self.b, self.variant = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d)), variant

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        if self.variant == "std":  # not a layer norm: unbiased std, eps outside the root
            return self.w * (x - u) / (x.std(-1, keepdim=True) + 1e-6) + self.b
        v = (x - u).pow(2).mean(-1, keepdim=True)
        if self.variant == "rsqrt":
            return self.w * ((x - u) * torch.rsqrt(v + 1e-5)) + self.b
        return self.w * ((x - u) / torch.sqrt(v + 1e-5)) + self.b


class NewGelu(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class QuickGelu(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class WrongGelu(nn.Module):
    def forward(self, x):  # 0.04 instead of 0.044715: not GELU
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.04 * torch.pow(x, 3.0))))


class Projections(nn.Module):
    def __init__(self, d=32, bias=True, shared=True):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d, bias), nn.Linear(d, d // 2, bias), nn.Linear(d, d // 2, bias)
        self.shared = shared

    def forward(self, x):
        y = x if self.shared else x * 2
        return self.q(x), self.k(y), self.v(x)


class ConvBn(nn.Module):
    def __init__(self, linear=False):
        super().__init__()
        self.conv = nn.Linear(8, 6) if linear else nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm1d(6) if linear else nn.BatchNorm2d(6)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class OneHotMlp(nn.Module):
    def __init__(self, n=20, d=8, form="matmul"):
        super().__init__()
        self.form, self.n = form, n
        self.table = nn.Parameter(torch.randn(n, d))
        self.lin = nn.Linear(n, d)

    def forward(self, idx):
        oh = F.one_hot(idx, self.n).float()
        if self.form == "matmul":
            return oh @ self.table
        if self.form == "linear":
            return self.lin(oh)
        return oh @ self.table, oh.sum()  # the one-hot is used elsewhere


class Swiglu(nn.Module):
    def __init__(self, d=16, packed=True, act="silu", activated_first=True):
        super().__init__()
        self.packed, self.act, self.first = packed, act, activated_first
        self.up = nn.Linear(d, 2 * d)

    def forward(self, x):
        a, b = self.up(x).chunk(2, -1)
        act = F.silu if self.act == "silu" else F.gelu
        if not self.first:
            return a * act(b)
        return act(a) * b


class Rotary(nn.Module):
    def forward(self, x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class HeadMerge(nn.Module):
    def forward(self, x):  # (B, N, S, D) -> (B, S, N*D)
        return x.transpose(1, 2).reshape(2, 8, 32)


# --- helpers -----------------------------------------------------------------------------------

def _same(model, cap, args, rtol=1e-5, atol=1e-5):
    params = list(model.parameters())
    want = outputs_and_grads(model, args, params)
    got = outputs_and_grads(cap, args, params)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def _rope_args():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 16)
    angle = torch.randn(1, 1, 8, 8)
    emb = torch.cat((angle, angle), -1)
    return x, emb.cos(), emb.sin()


# --- CPU forms ---------------------------------------------------------------------------------

@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_rms_norm_fires_and_keeps_numerics(front_end):
    model, x = HfRmsNorm(), torch.randn(4, 8, 32)
    cap, sites = rewrite(model, (x,), "fuse_rms_norm", front_end=front_end, training=True)
    assert len(sites) == 1 and "rms_norm" in code(cap) and "rsqrt" not in code(cap)
    _same(model, cap, (x,))


def test_rms_norm_keeps_hf_cast_before_weight_in_half_precision():
    model, x = HfRmsNorm().to(torch.bfloat16), torch.randn(4, 8, 32, dtype=torch.bfloat16)
    cap, sites = rewrite(model, (x,), "fuse_rms_norm")
    assert len(sites) == 1 and "weight folded" not in sites[0].description
    torch.testing.assert_close(cap(x), model(x))  # the same bf16 rounding points


def test_rms_norm_declines_when_an_intermediate_is_reused():
    class Reuse(HfRmsNorm):
        def forward(self, x):
            v = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(v + 1e-6) + v
    cap, sites = rewrite(Reuse(), (torch.randn(4, 32),), "fuse_rms_norm")
    assert sites == []


@pytest.mark.parametrize("variant", ["div", "rsqrt"])
def test_layer_norm_fires_and_keeps_numerics(variant):
    model, x = LayerNormByHand(variant=variant), torch.randn(4, 8, 32)
    cap, sites = rewrite(model, (x,), "fuse_layer_norm", training=True)
    assert len(sites) == 1 and "layer_norm" in code(cap)
    _same(model, cap, (x,), atol=1e-4)  # two-pass vs Welford variance: fp32 rounding


def test_layer_norm_declines_std_form():
    cap, sites = rewrite(LayerNormByHand(variant="std"), (torch.randn(4, 32),), "fuse_layer_norm")
    assert sites == []


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_tanh_gelu_fires_and_keeps_numerics(front_end):
    model, x = NewGelu(), torch.randn(4, 64)
    cap, sites = rewrite(model, (x,), "fuse_gelu", front_end=front_end, training=True)
    assert len(sites) == 1 and "approximate = 'tanh'" in code(cap) and "tanh(" not in code(cap).replace("approximate = 'tanh'", "")
    _same(model, cap, (x,))


def test_gelu_declines_wrong_constant_and_quick_gelu_without_dtype():
    assert rewrite(WrongGelu(), (torch.randn(8),), "fuse_gelu")[1] == []
    assert rewrite(QuickGelu(), (torch.randn(8),), "fuse_gelu")[1] == []


@pytest.mark.parametrize("bias", [True, False])
def test_qkv_projections_fire_keep_numerics_and_state_dict(bias):
    model, x = Projections(bias=bias), torch.randn(3, 5, 32)
    cap, sites = rewrite(model, (x,), "fuse_qkv_projections", training=True)
    assert len(sites) == 1 and code(cap).count("linear(") == 1 and "torch.cat" in code(cap)
    _same(model, cap, (x,))
    with torch.no_grad():  # a weight loaded after the rewrite is used: nothing was copied
        model.k.weight.mul_(2)
    torch.testing.assert_close(cap(x)[1], model(x)[1])


def test_qkv_projections_need_a_shared_input():
    cap, sites = rewrite(Projections(shared=False), (torch.randn(3, 32),), "fuse_qkv_projections")
    assert len(sites) == 1 and "2 linears" in sites[0].description  # q and v share x, k does not


@pytest.mark.parametrize("linear", [False, True])
def test_fold_batch_norm_in_inference(linear):
    model = ConvBn(linear).eval()
    x = torch.randn(4, 8) if linear else torch.randn(2, 3, 8, 8)
    cap, sites = rewrite(model, (x,), "fold_batch_norm")
    assert len(sites) == 1 and "batch_norm" not in code(cap)
    with torch.no_grad():
        torch.testing.assert_close(cap(x), model(x), rtol=1e-5, atol=1e-5)


def test_fold_batch_norm_declines_in_training():
    model = ConvBn().train()
    cap, sites = rewrite(model, (torch.randn(2, 3, 8, 8),), "fold_batch_norm", training=True)
    assert sites == []


@pytest.mark.parametrize("form", ["matmul", "linear"])
def test_one_hot_becomes_embedding(form):
    model, idx = OneHotMlp(form=form), torch.randint(0, 20, (4, 7))
    cap, sites = rewrite(model, (idx,), "fuse_one_hot", training=True)
    assert len(sites) == 1 and "embedding" in code(cap) and "one_hot" not in code(cap)
    params = list(model.parameters())
    want, got = outputs_and_grads(model, (idx,), params), outputs_and_grads(cap, (idx,), params)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_one_hot_declines_when_the_one_hot_is_used_elsewhere():
    cap, sites = rewrite(OneHotMlp(form="reused"), (torch.randint(0, 20, (4,)),), "fuse_one_hot")
    assert sites == []


# --- NPU-only forms on the reference shim ----------------------------------------------------------

def test_npu_only_passes_find_nothing_on_cpu():
    for model, args, name in [(Swiglu(), (torch.randn(2, 16),), "fuse_swiglu"),
                              (Rotary(), _rope_args(), "fuse_rotary_embedding"),
                              (HeadMerge(), (torch.randn(2, 4, 8, 8),), "fuse_confusion_transpose")]:
        assert rewrite(model, args, name)[1] == []


@pytest.mark.parametrize("packed", [True, False])
def test_swiglu_on_npu_shim(fake_torch_npu, packed):
    class TwoProj(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = nn.Linear(16, 32), nn.Linear(16, 32)

        def forward(self, x):
            return F.silu(self.gate(x)) * self.up(x)
    model = Swiglu() if packed else TwoProj()
    x = torch.randn(2, 5, 16)
    cap, sites = rewrite(model, (x,), "fuse_swiglu", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_swiglu" in code(cap)
    _same(model, cap, (x,))


def test_swiglu_second_half_activated_swaps_halves(fake_torch_npu):
    """npu_swiglu activates the first half (§1.6): a * silu(b) is fed as cat([b, a])."""
    model, x = Swiglu(activated_first=False), torch.randn(2, 16)
    cap, sites = rewrite(model, (x,), "fuse_swiglu", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "concatenated" in sites[0].description
    _same(model, cap, (x,))


def test_geglu_on_npu_shim_second_half_only(fake_torch_npu):
    model, x = Swiglu(act="gelu", activated_first=False), torch.randn(2, 16)
    cap, sites = rewrite(model, (x,), "fuse_geglu", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_geglu" in code(cap)
    _same(model, cap, (x,))
    # gelu on the first half: the docs disagree on activate_left=True, so it is declined
    assert rewrite(Swiglu(act="gelu"), (x,), "fuse_geglu", backend=NpuBackend())[1] == []


def test_rotary_on_npu_shim(fake_torch_npu):
    model, args = Rotary(), _rope_args()
    cap, sites = rewrite(model, args, "fuse_rotary_embedding", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_rotary_mul" in code(cap)
    _same(model, cap, args)


def test_rotary_declines_odd_table_shapes(fake_torch_npu):
    x, cos, sin = _rope_args()
    bad = (x, cos[..., :1, :], sin)  # cos not per position: not a rotary table
    assert rewrite(Rotary(), bad, "fuse_rotary_embedding", backend=NpuBackend())[1] == []


def test_confusion_transpose_on_npu_shim(fake_torch_npu):
    model, x = HeadMerge(), torch.randn(2, 4, 8, 8)
    cap, sites = rewrite(model, (x,), "fuse_confusion_transpose", backend=NpuBackend())
    assert len(sites) == 1 and "npu_confusion_transpose" in code(cap)
    torch.testing.assert_close(cap(x), model(x))


def test_rms_norm_and_gelu_npu_forms_on_shim(fake_torch_npu):
    for model, x, name, op in [(HfRmsNorm(), torch.randn(4, 32), "fuse_rms_norm", "npu_rms_norm"),
                               (NewGelu(), torch.randn(4, 32), "fuse_gelu", "npu_gelu")]:
        cap, sites = rewrite(model, (x,), name, training=True, backend=NpuBackend())
        assert len(sites) == 1 and op in code(cap)
        _same(model, cap, (x,))


def test_quick_gelu_on_npu_only_with_dtype(fake_torch_npu):
    from rewriter.capture.front_ends import capture
    from rewriter.pass_api import PassContext, registered_passes
    model, x = QuickGelu(), torch.randn(4, 32)
    p = registered_passes()["fuse_gelu"]
    cap = capture(model, (x,), {}, "fx")
    assert p.find(cap.slots[0].kept, PassContext(NpuBackend(), False, None)) == []
    sites = cap.slots[0].try_pass(p, PassContext(NpuBackend(), False, torch.bfloat16))
    cap.slots[0].accept()
    assert len(sites) == 1 and "npu_fast_gelu" in code(cap)
    torch.testing.assert_close(cap(x), model(x))  # the A2/A3 formula is x*sigmoid(1.702x)
