"""The NPU forms against the strict shim: what torch_npu's kernels check (device of every
tensor, mask shapes, dtypes and dtype pairs, head and head-dim limits, keep_prob, chip and
version), under an Atlas A2 part and an Atlas 300I/310P part at the oldest torch_npu the
project claims (the ``npu_target`` fixture), plus the four bugs of issue 18.

A graph that makes a tensor on the CPU runs fine when the model is on the CPU too; run on
``meta`` (``on_meta``) that tensor meets an input on another device and the shim's device check
shows it, as the NPU kernels would.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewriter
from rewriter.devices import optimizers
from rewriter.devices.backends import NpuBackend
from rewriter.devices.npu_capabilities import MIN_TORCH_NPU, chip_family, torch_npu_release, version_problem
from rewriter.pass_api import PassContext, registered_passes
from tests import npu_shim
from tests.controlled import QUICK, ControlledClock
from tests.helpers import code, outputs_and_grads, rewrite
from tests.test_fused_ops import HeadMerge, NewGelu, Rotary, Swiglu

A2, P310 = npu_shim.A2_CHIP, npu_shim.P310_CHIP


def on_meta(cap, args, training=True):
    """Run the rewritten fx graph with its parameters and inputs on ``meta`` (and backward)."""
    gm = copy.deepcopy(cap.slots[0].kept).to("meta")
    meta = [a.to("meta").requires_grad_(training and a.is_floating_point()) for a in args]
    out = gm(*meta)
    if training:
        out.float().sum().backward()
    return out


def _same(model, cap, args, rtol=1e-5, atol=1e-5):
    params = list(model.parameters())
    want, got = outputs_and_grads(model, args, params), outputs_and_grads(cap, args, params)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def _find(pass_name, model, args, training=True, dtype=None):
    """(sites, declined reasons) of ``pass_name`` on a fresh capture of ``model``."""
    from rewriter.capture.front_ends import capture
    ctx = PassContext(NpuBackend(), training, dtype)
    sites = registered_passes()[pass_name].find(capture(model, args, {}, "fx").slots[0].kept, ctx)
    return sites, ctx.declined


def _not_applicable(pass_name, training=True, dtype=None):
    return registered_passes()[pass_name].applies_to(PassContext(NpuBackend(), training, dtype))


class Attention(nn.Module):
    """Hand-written attention on (B, N, S, D) q, k, v with a boolean keep mask of any shape."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, keep):
        s = (q @ k.transpose(-2, -1)) * 0.25
        s = s.masked_fill(~keep, float("-inf"))
        return F.dropout(F.softmax(s, dim=-1), self.dropout, self.training) @ v


class RmsNoWeight(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention_args(b=2, n=4, s=8, d=16, mask=(2, 1, 1, 8)):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d) for _ in range(3))
    keep = torch.rand(mask) > 0.3
    keep[..., 0] = True  # no row fully masked
    return q, k, v, keep


# --- the four bugs -------------------------------------------------------------------------------

class CausalAttention(nn.Module):
    def __init__(self, s=8):
        super().__init__()
        self.register_buffer("causal", torch.tril(torch.ones(s, s, dtype=torch.bool)))

    def forward(self, q, k, v):
        scores = torch.where(self.causal, q @ k.transpose(-2, -1) * 0.25, float("-inf"))
        return F.softmax(scores, dim=-1) @ v


def test_bug1_causal_mask_is_made_on_the_query_device(emulate):
    emulate(A2, npu_shim.OLDEST_VERSION)
    model, args = CausalAttention(), _attention_args()[:3]
    cap, sites = rewrite(model, args, "fuse_attention", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "sparse_mode = 2" in code(cap)
    assert on_meta(cap, args).device.type == "meta"  # was: the 2048x2048 mask made on the CPU
    _same(model, cap, args)


@pytest.mark.parametrize("chip", [A2, P310])
def test_bug2_rms_norm_without_weight_gets_gamma_of_x_dtype_and_device(emulate, chip):
    emulate(chip, npu_shim.OLDEST_VERSION)
    model = RmsNoWeight()
    x = torch.randn(4, 32, dtype=torch.float16)  # (fp16 x, fp32 gamma) is no pair on 310P
    cap, sites = rewrite(model, (x,), "fuse_rms_norm", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_rms_norm" in code(cap)
    torch.testing.assert_close(cap(x), model(x), rtol=1e-3, atol=1e-3)  # fp16: the default bound
    on_meta(cap, (x,))


@pytest.mark.parametrize("mask", [(2, 1, 1, 8), (1, 4, 8, 8), (8,), (2, 4, 1, 8)])
def test_bug3_masks_are_expanded_to_a_documented_shape(emulate, mask):
    emulate(A2, npu_shim.OLDEST_VERSION)
    model, args = Attention(), _attention_args(mask=mask)
    cap, sites = rewrite(model, args, "fuse_attention", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_fusion_attention" in code(cap)
    _same(model, cap, args)  # was: the strict shim refused the mask's shape
    on_meta(cap, args)
    assert "inner_precise = 2" in code(cap)  # masked rows, as torch_npu's SDPA passes (§1.1)


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_bug4_fused_adam_taking_over_a_stepped_optimizer_steps_once(emulate, name):
    emulate(A2, npu_shim.OLDEST_VERSION)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(3):  # torch keeps state['step'] as a 0-d tensor
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ref_model = copy.deepcopy(model)
    ref_opt = getattr(torch.optim, name)(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own moment buffers
    found, _ = optimizers.candidates(opt, NpuBackend())
    fused = found[0].switch(opt)
    assert type(fused).__name__ == f"NpuFused{name}"
    for _ in range(5):
        for m, o in ((model, fused), (ref_model, ref_opt)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(st["step"] == 8 for st in fused.state.values())


def test_the_gate_keeps_fused_adamw_over_a_stepped_optimizer(emulate):
    """Through optimize(): the fused optimizer's 5-step check passes only with one step per step."""
    emulate(A2, npu_shim.OLDEST_VERSION)
    torch.manual_seed(0)
    model, x, y = nn.Linear(8, 4), torch.randn(16, 8), torch.randn(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    fast, opt2 = rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda o: F.mse_loss(o, y),
                                   device=NpuBackend(), passes=[], clock=ControlledClock({"fuse_optimizer": 0.25}),
                                   gate=QUICK, progress=False, profile=False)
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_optimizer")
    assert d.status == "kept" and type(opt2).__name__ == "NpuFusedAdamW", d.reason


# --- the strict shim refuses what the kernels refuse ---------------------------------------------

def test_shim_rejects_a_cpu_tensor_beside_an_npu_input(emulate):
    shim = emulate(A2, npu_shim.OLDEST_VERSION)
    q = torch.randn(1, 1, 4, 8, device="meta")
    with pytest.raises(RuntimeError, match="same device"):
        shim.npu_fusion_attention(q, q, q, 1, "BNSD", atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
                                  sparse_mode=2)
    with pytest.raises(RuntimeError, match="same device"):
        shim.npu_rms_norm(torch.randn(2, 8, device="meta"), torch.ones(8))


def test_shim_enforces_attention_limits(emulate):
    shim = emulate(A2, npu_shim.OLDEST_VERSION)
    q = torch.randn(2, 4, 8, 16)
    with pytest.raises(RuntimeError, match="BNSS, B1SS, 11SS, SS"):
        shim.npu_fusion_attention(q, q, q, 4, "BNSD", atten_mask=torch.zeros(2, 1, 1, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="atten_mask"):
        shim.npu_fusion_attention(q, q, q, 4, "BNSD", atten_mask=torch.zeros(8, 8))
    with pytest.raises(RuntimeError, match="keep_prob"):
        shim.npu_fusion_attention(q, q, q, 4, "BNSD", keep_prob=0.0)
    with pytest.raises(RuntimeError, match="one shape"):
        shim.npu_fusion_attention(q, q, q[..., :8], 4, "BNSD")
    big = torch.randn(1, 257, 2, 8)
    with pytest.raises(RuntimeError, match="1..256"):
        shim.npu_fusion_attention(big, big, big, 257, "BNSD")
    with pytest.raises(TypeError, match="share a dtype"):
        shim.npu_fusion_attention(q, q.half(), q.half(), 4, "BNSD")


def test_shim_emulates_chip_and_version(emulate):
    shim = emulate(P310, npu_shim.OLDEST_VERSION)
    assert shim.npu.get_device_name() == P310 and shim.npu.is_bf16_supported() is False
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="not supported on Ascend310P3"):
        shim.npu_fusion_attention(q, q, q, 1, "BNSD")
    with pytest.raises(TypeError, match="not supported"):
        shim.npu_rms_norm(torch.randn(2, 16, dtype=torch.float16), torch.ones(16))  # (fp16, fp32)
    assert not hasattr(emulate(A2, npu_shim.TOO_OLD_VERSION), "npu_gelu")  # TorchNPU 6.0.rc3


# --- capability facts -----------------------------------------------------------------------------

def test_chip_families_and_versions():
    assert [chip_family(c) for c in ("Ascend910B2", "Ascend910B4-1", "Ascend910_9392", "Ascend910B",
                                     "Ascend910ProA", "Ascend310P3", "Ascend950DT", "Ascend310B1")] == \
        ["A2", "A2", "A3", "training", "training", "inference", "950", "other"]
    assert torch_npu_release("2.4.0.post2") == "6.0.0" and torch_npu_release("2.7.1.post5") == "26.0.0"
    assert torch_npu_release("2.4.0") == "6.0.rc3" and torch_npu_release("1.11.0") is None
    assert version_problem(MIN_TORCH_NPU) is None and version_problem("2.12.0") is None
    assert "older than 2.4.0.post2" in version_problem("2.4.0")
    assert "older than" in version_problem("2.1.0.post10") and "unreadable" in version_problem("")


def test_backend_reads_chip_version_and_bf16(emulate):
    emulate(P310, npu_shim.OLDEST_VERSION)
    backend = NpuBackend()
    caps = backend.capabilities()
    assert (caps.chip, caps.version, caps.bf16) == (P310, npu_shim.OLDEST_VERSION, False)
    assert backend.amp_dtypes == (torch.float16,)
    emulate(A2, npu_shim.OLDEST_VERSION)
    assert NpuBackend().amp_dtypes == (torch.float16, torch.bfloat16)


# --- every NPU form, on both chips ---------------------------------------------------------------

def test_attention_form(npu_target):
    _, chip = npu_target
    model, args = Attention(), _attention_args(mask=(8, 8))
    cap, sites = rewrite(model, args, "fuse_attention", training=True, backend=NpuBackend())
    if chip == P310:
        why = _not_applicable("fuse_attention")
        assert "npu_fusion_attention is documented for" in why and "not Ascend310P3" in why
        assert sites == []
        # inference keeps SDPA, which torch_npu routes itself: no chip gate there
        assert _not_applicable("fuse_attention", training=False) is None
        return
    assert len(sites) == 1 and "npu_fusion_attention" in code(cap)
    _same(model, cap, args)
    on_meta(cap, args)


@pytest.mark.parametrize("case, reason", [
    ("heads", "1-256 query heads, not 300"),
    ("dropout_all", "keep_prob must be in (0, 1]"),
    ("additive", "would go in as pse"),
])
def test_attention_declines_with_the_reason(emulate, case, reason):
    emulate(A2, npu_shim.OLDEST_VERSION)
    if case == "heads":
        model, args = Attention(), _attention_args(n=300, s=2, d=8, mask=(2, 2))
    elif case == "dropout_all":
        model, args = Attention(dropout=1.0).train(), _attention_args(mask=(8, 8))
    else:
        class Additive(nn.Module):
            def forward(self, q, k, v, m):
                return F.softmax(q @ k.transpose(-2, -1) * 0.25 + m, dim=-1) @ v
        model, args = Additive(), _attention_args(mask=(8, 8))[:3] + (torch.randn(8, 8),)
    sites, declined = _find("fuse_attention", model, args)
    assert sites == [] and any(reason in d for d in declined), declined


def test_rms_norm_form(npu_target):
    _, chip = npu_target
    from tests.test_fused_ops import HfRmsNorm
    model, x = HfRmsNorm(), torch.randn(4, 32)
    cap, sites = rewrite(model, (x,), "fuse_rms_norm", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_rms_norm" in code(cap)
    _same(model, cap, (x,))
    on_meta(cap, (x,))
    found, declined = _find("fuse_rms_norm", RmsNoWeight(), (torch.randn(4, 32, dtype=torch.bfloat16),))
    short, short_declined = _find("fuse_rms_norm", RmsNoWeight(), (torch.randn(4, 4),))
    if chip == P310:  # no bf16 on 310P, and a tail axis under 32 bytes
        assert found == [] and "is_bf16_supported() is False" in declined[0]
        assert short == [] and "tail axis of >= 32 bytes, not 16" in short_declined[0]
    else:
        assert len(found) == 1 and len(short) == 1


def test_rms_norm_declines_a_weight_of_another_dtype(emulate):
    emulate(A2, npu_shim.OLDEST_VERSION)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(32))  # fp32 weight on a bf16 input: PyTorch promotes

        def forward(self, x):
            return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    sites, declined = _find("fuse_rms_norm", Mixed(), (torch.randn(4, 32, dtype=torch.bfloat16),))
    assert sites == [] and "returns x's dtype torch.bfloat16 where PyTorch promotes" in declined[0]


def test_gelu_form(npu_target):
    _, chip = npu_target
    model, x = NewGelu(), torch.randn(4, 32)
    cap, sites = rewrite(model, (x,), "fuse_gelu", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_gelu" in code(cap)
    _same(model, cap, (x,))
    on_meta(cap, (x,))
    found, declined = _find("fuse_gelu", model, (x.bfloat16(),))
    assert (found == []) == (chip == P310)
    if chip == P310:
        assert "is_bf16_supported() is False" in declined[0]


def test_gelu_declined_on_a3_and_below_the_version_floor(emulate):
    emulate(npu_shim.A3_CHIP, npu_shim.NEWEST_VERSION)
    why = _not_applicable("fuse_gelu")
    assert "npu_gelu is documented for" in why and "not Ascend910_9392 (Atlas A3)" in why
    emulate(A2, npu_shim.TOO_OLD_VERSION)
    why = _not_applicable("fuse_gelu")
    assert "torch_npu 2.4.0 (TorchNPU 6.0.rc3) is older than 2.4.0.post2" in why
    # through optimize(): the report carries the decision and its reason
    fast = rewriter.optimize(NewGelu(), (torch.randn(4, 32),), device=NpuBackend(), passes=["fuse_gelu"],
                             gate=QUICK, progress=False, profile=False)
    d = fast.report.decisions[0]
    assert d.status == "not applicable" and "older than 2.4.0.post2" in d.reason


def test_quick_gelu_form(npu_target):
    from tests.test_fused_ops import QuickGelu
    model, x = QuickGelu(), torch.randn(4, 32)
    p = registered_passes()["fuse_gelu"]
    cap = rewrite(model, (x,), "fuse_layer_norm", backend=NpuBackend())[0]  # capture only
    sites = cap.slots[0].try_pass(p, PassContext(NpuBackend(), False, torch.float16))
    cap.slots[0].accept()
    assert len(sites) == 1 and "npu_fast_gelu" in code(cap)
    torch.testing.assert_close(cap(x), model(x))
    on_meta(cap, (x,), training=False)


def test_swiglu_form(npu_target):
    _, chip = npu_target
    model, x = Swiglu(), torch.randn(2, 5, 16)
    cap, sites = rewrite(model, (x,), "fuse_swiglu", training=True, backend=NpuBackend())
    if chip == P310:
        assert sites == []
        assert "npu_swiglu is documented for Atlas A2, not Ascend310P3" in _not_applicable("fuse_swiglu")
        return
    assert len(sites) == 1 and "npu_swiglu" in code(cap)
    _same(model, cap, (x,))
    on_meta(cap, (x,))


def test_geglu_form(npu_target):
    _, chip = npu_target
    model, x = Swiglu(act="gelu", activated_first=False), torch.randn(2, 16)
    cap, sites = rewrite(model, (x,), "fuse_geglu", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_geglu" in code(cap)
    _same(model, cap, (x,))
    on_meta(cap, (x,))
    found, declined = _find("fuse_geglu", model.bfloat16(), (x.bfloat16(),))
    assert (found == []) == (chip == P310)
    if chip == P310:
        assert "is_bf16_supported() is False" in declined[0]


def _rope(d, shape=(2, 4, 8), table="11SD"):
    torch.manual_seed(0)
    b, n, s = shape
    x = torch.randn(b, n, s, d)
    angle = torch.randn((1, 1, s, d // 2) if table == "11SD" else (1, n, s, d // 2))
    emb = torch.cat((angle, angle), -1)
    return x, emb.cos(), emb.sin()


def test_rotary_form(npu_target):
    _, chip = npu_target
    for d in (16, 128):
        args = _rope(d)
        cap, sites = rewrite(Rotary(), args, "fuse_rotary_embedding", training=True, backend=NpuBackend())
        if chip == P310 and d != 128:  # online compiling: D == 128 only
            sites, declined = _find("fuse_rotary_embedding", Rotary(), args)
            assert sites == [] and "compiles online (jit_compile=True): needs D == 128" in declined[0]
            continue
        assert len(sites) == 1 and "npu_rotary_mul" in code(cap)
        _same(Rotary(), cap, args)
        on_meta(cap, args)


def test_rotary_declines_undocumented_tables_and_dtypes(emulate):
    emulate(A2, npu_shim.OLDEST_VERSION)
    sites, declined = _find("fuse_rotary_embedding", Rotary(), _rope(16, table="1NSD"))  # not 11SD/B1SD/BNSD
    assert sites == [] and "not a documented table layout" in declined[0]
    x, cos, sin = _rope(16)
    sites, declined = _find("fuse_rotary_embedding", Rotary(), (x, cos.double(), sin.double()))
    assert sites == [] and "differ from x's torch.float32" in declined[0]


def test_confusion_transpose_form(npu_target):
    model, x = HeadMerge(), torch.randn(2, 4, 8, 8)
    cap, sites = rewrite(model, (x,), "fuse_confusion_transpose", backend=NpuBackend())
    assert len(sites) == 1 and "npu_confusion_transpose" in code(cap)
    torch.testing.assert_close(cap(x), model(x))
    on_meta(cap, (x,), training=False)
    sites, declined = _find("fuse_confusion_transpose", model, (x.bfloat16(),), training=False)
    assert sites == [] and "npu_confusion_transpose does not take torch.bfloat16" in declined[0]


def test_fused_optimizer_form(npu_target):
    _, chip = npu_target
    model = nn.Linear(8, 4)
    found, why = optimizers.candidates(torch.optim.AdamW(model.parameters()), NpuBackend())
    if chip == P310:
        assert found == [] and "not Ascend310P3" in why
    else:
        assert len(found) == 1
        found, why = optimizers.candidates(torch.optim.AdamW(model.parameters(), maximize=True), NpuBackend())
        assert found == [] and "has no maximize=True" in why


def test_bf16_autocast_only_where_the_chip_has_it(npu_target):
    _, chip = npu_target
    why = _not_applicable("cast_to_half", dtype=torch.bfloat16)
    if chip == P310:
        assert "torch.bfloat16 is not a fast autocast dtype on npu" in why
    else:
        assert why is None
    assert _not_applicable("cast_to_half", dtype=torch.float16) is None


def test_declined_sites_reach_the_report(emulate):
    emulate(P310, npu_shim.OLDEST_VERSION)
    # D = 16: 310P's online-compiled rotary needs D == 128
    fast = rewriter.optimize(Rotary(), _rope(16), device=NpuBackend(), passes=["fuse_rotary_embedding"],
                             gate=QUICK, progress=False, profile=False)
    d = fast.report.decisions[0]
    assert d.status == "no sites" and "needs D == 128" in d.reason


# --- the decode step's attention: npu_fused_infer_attention_score (FIA) ------------------------

class DecodeAttention(nn.Module):
    """A decode step: a one-token query, the cached k/v repeated for grouped-query attention as
    transformers' ``repeat_kv`` does, a padding mask filled with fp16's minimum."""

    def __init__(self, rep=2, d=16, dtype=torch.float16):
        super().__init__()
        self.rep, self.scale, self.dtype = rep, d ** -0.5, dtype

    def forward(self, q, k, v, keep):
        b, nkv, s, d = k.shape
        k = k[:, :, None, :, :].expand(b, nkv, self.rep, s, d).reshape(b, nkv * self.rep, s, d)
        v = v[:, :, None, :, :].expand(b, nkv, self.rep, s, d).reshape(b, nkv * self.rep, s, d)
        scores = (q @ k.transpose(-2, -1) * self.scale).masked_fill(~keep, -65504.0)  # fp16's min
        return F.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def _decode_args(dtype=torch.float16, sq=1, d=16, n=4, nkv=2, s=12):
    torch.manual_seed(0)
    q = torch.randn(2, n, sq, d, dtype=dtype)
    k, v = (torch.randn(2, nkv, s, d, dtype=dtype) for _ in range(2))
    keep = torch.ones(2, 1, sq, s, dtype=torch.bool)
    keep[1, ..., :3] = False  # the second sequence is left-padded
    return q, k, v, keep


def test_decode_attention_form(npu_target):
    """A2 (TorchNPU 6.0.0, where the scale is ``scale_value``, and 26.1.0, ``scale``): FIA with
    the grouped k/v as they are; the 310P part keeps SDPA (FIA is documented for A2/A3)."""
    shim, chip = npu_target
    model, args = DecodeAttention(), _decode_args()
    cap, sites = rewrite(model, args, "fuse_attention", training=False, backend=NpuBackend())
    assert len(sites) == 1
    text = code(cap)
    if chip == P310:
        assert "npu_fused_infer_attention_score" not in text and "scaled_dot_product_attention" in text
        return
    assert "npu_fused_infer_attention_score" in text  # (the shim checks k's heads against num_key_value_heads)
    import inspect
    keyword = "scale" if "scale" in inspect.signature(shim.npu_fused_infer_attention_score).parameters \
        else "scale_value"
    assert f"{keyword} = 0.25" in text and "num_key_value_heads = 2" in text
    with torch.no_grad():
        torch.testing.assert_close(cap(*args), model(*args), rtol=2e-3, atol=2e-3)  # fp16, 12 keys
    with torch.no_grad():
        on_meta(cap, args, training=False)  # every tensor on the inputs' device


@pytest.mark.parametrize("case, kept", [
    ("prefill", "scaled_dot_product_attention"),   # a query of 8 tokens: not a decode step
    ("fp32", "scaled_dot_product_attention"),      # FIA takes fp16/bf16 only
    ("head_dim_8", "scaled_dot_product_attention"),  # D must be a multiple of 16
    ("training", "npu_fusion_attention"),          # FIA has no backward
    ("grad", "scaled_dot_product_attention"),      # eval, but a query that requires grad
    ("per_head_mask", "scaled_dot_product_attention"),  # not one of FIA's one-token mask shapes
])
def test_fia_only_where_it_serves(emulate, case, kept):
    emulate(A2, npu_shim.NEWEST_VERSION)

    def per_head():
        q, k, v, _ = _decode_args()
        keep = torch.rand(2, 4, 1, 12) > 0.3
        keep[..., 0] = True
        return q, k, v, keep
    args = {"prefill": lambda: _decode_args(sq=8), "fp32": lambda: _decode_args(torch.float32),
            "head_dim_8": lambda: _decode_args(d=8), "training": lambda: _decode_args(),
            "grad": lambda: (_decode_args()[0].requires_grad_(),) + _decode_args()[1:],
            "per_head_mask": per_head}[case]()
    cap, sites = rewrite(DecodeAttention(d=args[0].shape[-1], dtype=args[0].dtype), args, "fuse_attention",
                         training=case == "training", backend=NpuBackend())
    text = code(cap)
    assert len(sites) == 1 and kept in text and "npu_fused_infer_attention_score" not in text


def test_fia_scale_keyword_follows_the_release():
    from rewriter.devices.npu_decode_attention import fia_scale_keyword
    assert fia_scale_keyword("2.4.0.post2") == "scale_value"   # TorchNPU 6.0.0
    assert fia_scale_keyword("2.4.0.post4") == "scale"         # 7.0.0
    assert fia_scale_keyword("2.12.0") == "scale" and fia_scale_keyword("1.11.0") is None


def test_shim_enforces_fia_limits(emulate):
    shim = emulate(A2, npu_shim.OLDEST_VERSION)
    q, k, v, _ = _decode_args()
    fia = shim.npu_fused_infer_attention_score
    with pytest.raises(TypeError, match="scale"):
        fia(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.25)  # 7.0.0's name
    with pytest.raises(RuntimeError, match="not contiguous"):
        fia(q, k.transpose(-2, -1).contiguous().transpose(-2, -1), v, num_heads=4,
            num_key_value_heads=2, input_layout="BNSD")
    with pytest.raises(TypeError, match="not supported"):
        fia(q.float(), k.float(), v.float(), num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    with pytest.raises(RuntimeError, match="autograd kernel"):
        fia(q.requires_grad_(), k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    with pytest.raises(RuntimeError, match="must end in"):
        fia(q.detach(), k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
            atten_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="not supported on Ascend310P3"):
        emulate(P310, npu_shim.OLDEST_VERSION).npu_fused_infer_attention_score(
            q.detach(), k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD")


def test_fia_gets_its_one_token_mask_shape_from_a_mask_written_for_every_batch(emulate):
    """A (1, KV_S) mask (one for all sequences) is expanded to (B, 1, 1, KV_S): FIA would read a
    2-D mask as (B, KV_S)."""
    emulate(A2, npu_shim.NEWEST_VERSION)
    q, k, v, _ = _decode_args()
    keep = torch.ones(1, 12, dtype=torch.bool)
    keep[0, :2] = False
    model, args = DecodeAttention(), (q, k, v, keep)
    cap, sites = rewrite(model, args, "fuse_attention", training=False, backend=NpuBackend())
    assert len(sites) == 1 and "npu_fused_infer_attention_score" in code(cap)
    with torch.no_grad():
        torch.testing.assert_close(cap(*args), model(*args), rtol=2e-3, atol=2e-3)
