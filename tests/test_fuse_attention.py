import pytest
import torch
import torch.nn.functional as F

from rewriter.devices.backends import NpuBackend
from tests.helpers import code, outputs_and_grads, rewrite
from tests.models import HandAttention

B, T, D = 2, 16, 32


def _inputs(variant):
    torch.manual_seed(0)
    x = torch.randn(B, T, D)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    if variant == "additive":
        return (x, torch.zeros(T, T).masked_fill(~causal, float("-inf")))
    if variant in ("masked_fill", "where", "small_fill"):
        return (x, causal)
    if variant == "two_masks":
        return (x, (causal, torch.zeros(T, T)))
    if variant == "mask_then_scale":
        return (x, torch.zeros(T, T))
    return (x,)


# fp32: the fused kernel reorders the softmax and matmul reductions (a few ulps of the
# largest value), so gradients that are analytically zero come out near 1e-6.
def _check_same(model, cap, args, rtol=1e-5, atol=1e-5):
    params = list(model.parameters())
    want_out, want_grad = outputs_and_grads(model, args, params)
    got_out, got_grad = outputs_and_grads(cap, args, params)
    for g, w in zip(got_out + got_grad, want_out + want_grad):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("variant", ["mul", "div", "noscale", "additive", "masked_fill", "where"])
def test_fuses_and_keeps_outputs_and_grads(variant, front_end):
    model = HandAttention(variant)
    args = _inputs(variant)
    cap, sites = rewrite(model, args, "fuse_attention", front_end=front_end, training=True)
    assert len(sites) == 1
    assert "scaled_dot_product_attention" in code(cap)
    assert "softmax" not in code(cap)
    _check_same(model, cap, args)


def test_scale_defaults_to_one_not_sdpa_default():
    model = HandAttention("noscale")
    cap, sites = rewrite(model, _inputs("noscale"), "fuse_attention")
    assert "scale = 1.0" in code(cap)


def test_dropout_probability_carried_into_fused_call():
    model = HandAttention("mul", dropout=0.25).train()
    cap, sites = rewrite(model, _inputs("mul"), "fuse_attention", training=True)
    assert len(sites) == 1 and "dropout_p = 0.25" in code(cap)


def test_eval_mode_dropout_becomes_zero():
    model = HandAttention("mul", dropout=0.25).eval()
    cap, _ = rewrite(model, _inputs("mul"), "fuse_attention")
    assert "dropout_p = 0.0" in code(cap)


@pytest.mark.parametrize("variant", ["mask_then_scale", "small_fill", "dim2"])
def test_declines_what_it_cannot_express(variant):
    model = HandAttention(variant)
    cap, sites = rewrite(model, _inputs(variant), "fuse_attention")
    assert sites == []
    assert "softmax" in code(cap)


def test_declines_when_attention_weights_are_used_elsewhere():
    model = HandAttention("mul", return_weights=True)
    cap, sites = rewrite(model, _inputs("mul"), "fuse_attention")
    assert sites == []


def test_npu_declines_a_dtype_it_does_not_take(fake_torch_npu):
    model = HandAttention("mul").double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    cap, sites = rewrite(model, (x,), "fuse_attention", training=True, backend=NpuBackend())
    assert sites == []
    cap, sites = rewrite(model, (x,), "fuse_attention", training=True)  # SDPA takes float64
    assert len(sites) == 1


def test_npu_training_form_matches_the_reference_shim(fake_torch_npu):
    model = HandAttention("masked_fill")
    args = _inputs("masked_fill")
    cap, sites = rewrite(model, args, "fuse_attention", training=True, backend=NpuBackend())
    assert len(sites) == 1
    assert "npu_fusion_attention" in code(cap) and "BNSD" in code(cap)
    _check_same(model, cap, args)


def test_npu_takes_transformers_style_additive_mask_as_boolean(fake_torch_npu):
    class WhereMask(torch.nn.Module):
        def forward(self, q, k, v, keep):
            mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
            return F.softmax(q @ k.transpose(-1, -2) * 0.3 + mask[:, :, :, :8], dim=-1) @ v
    torch.manual_seed(0)
    keep = torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8)
    args = (torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), keep)
    model = WhereMask()
    cap, sites = rewrite(model, args, "fuse_attention", training=True, backend=NpuBackend())
    assert len(sites) == 1 and "npu_fusion_attention" in code(cap)
    torch.testing.assert_close(cap(*args), model(*args), rtol=1e-5, atol=1e-6)


def test_npu_declines_arbitrary_float_mask(fake_torch_npu):
    model = HandAttention("additive")
    cap, sites = rewrite(model, _inputs("additive"), "fuse_attention", training=True,
                         backend=NpuBackend())
    assert sites == []


def test_npu_inference_uses_sdpa_with_boolean_mask(fake_torch_npu):
    model = HandAttention("where").eval()
    args = _inputs("where")
    cap, sites = rewrite(model, args, "fuse_attention", training=False, backend=NpuBackend())
    assert len(sites) == 1 and "scaled_dot_product_attention" in code(cap)
    with torch.no_grad():
        torch.testing.assert_close(cap(*args), model(*args), rtol=1e-5, atol=1e-6)


def test_shim_follows_documented_mask_polarity(fake_torch_npu):
    """True in atten_mask means masked out (reference §1.1), the opposite of SDPA."""
    q = k = v = torch.randn(1, 1, 4, 8)
    masked = torch.tril(torch.ones(4, 4, dtype=torch.bool)).logical_not()
    got = fake_torch_npu.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=masked, scale=0.5)[0]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, scale=0.5)
    torch.testing.assert_close(got, want)


def test_causal_tril_buffer_becomes_is_causal():
    from rewriter.examples import TunedBlock
    torch.manual_seed(0)
    model = TunedBlock(in_features=32, hidden=32, heads=4, max_len=16).eval()
    x = torch.randn(2, 16, 32)
    cap, sites = rewrite(model, (x,), "fuse_attention", front_end="dynamo")
    assert len(sites) == 1 and "causal" in sites[0].description
    assert "is_causal = True" in code(cap)
    with torch.no_grad():
        torch.testing.assert_close(cap(x), model(x), rtol=1e-5, atol=1e-5)


def test_non_causal_buffer_stays_a_mask():
    from rewriter.examples import TunedBlock
    model = TunedBlock(in_features=32, hidden=32, heads=4, max_len=16).eval()
    model.causal[3, 1] = False  # no longer lower-triangular
    cap, sites = rewrite(model, (torch.randn(2, 16, 32),), "fuse_attention", front_end="dynamo")
    assert len(sites) == 1 and "causal" not in sites[0].description and "is_causal" not in code(cap)


def test_npu_causal_uses_compressed_mask_and_sparse_mode(fake_torch_npu):
    from rewriter.examples import TunedBlock
    torch.manual_seed(0)
    model = TunedBlock(in_features=32, hidden=32, heads=4, max_len=16).train()
    x = torch.randn(2, 16, 32)
    cap, sites = rewrite(model, (x,), "fuse_attention", front_end="dynamo", training=True,
                         backend=NpuBackend())
    assert "sparse_mode = 2" in code(cap) and "triu" in code(cap)
    torch.testing.assert_close(cap(x), model(x), rtol=1e-5, atol=1e-5)


def test_additive_bool_mask_is_its_float_value_not_a_keep_mask():
    """pytorch's test_sdpa_rewriter_5 form: scores + bool adds +1/+0; SDPA would read keep/drop."""
    class AddBool(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.softmax(q @ k.transpose(-2, -1) / 0.5 + mask, dim=-1) @ v
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=gen) for _ in range(3))
    mask = torch.randn(1, 1, 8, 8, generator=gen) > 0
    model = AddBool()
    cap, sites = rewrite(model, (q, k, v, mask), "fuse_attention")
    assert len(sites) == 1
    _check_same(model, cap, (q, k, v, mask))


def test_a_bool_fill_and_an_additive_mask_become_one_additive_mask():
    model = HandAttention("two_masks")
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x, bias = torch.randn(B, T, D), torch.randn(T, T)
    cap, sites = rewrite(model, (x, (causal, bias)), "fuse_attention", training=True)
    assert len(sites) == 1 and "2 masks combined" in sites[0].description
    params = list(model.parameters())
    for g, w in zip(*(sum(outputs_and_grads(f, (x, (causal, bias)), params), []) for f in (cap, model))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# --- the forms real model code writes: fired, numerics, declines, NPU shim -----------------------

class Forms(torch.nn.Module):
    """One attention in the spelling ``form`` names, on (B, N, S, D) q, k, v (k/v (B, 1, S, D)
    for "multi_query") and an optional extra input."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, q, k, v, extra=None):
        f, d = self.form, q.shape[-1]
        if f == "baddbmm" or f == "baddbmm_beta2":  # BLOOM: alibi, views around the mask
            b, n, s, _ = q.shape
            scores = extra[0].baddbmm(q.reshape(b * n, s, d), k.reshape(b * n, s, d).transpose(-1, -2),
                                      beta=2.0 if f == "baddbmm_beta2" else 1.0, alpha=d ** -0.5)
            w = scores.view(b, n, s, s).masked_fill(~extra[1], torch.finfo(q.dtype).min)
            p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.bmm(p.view(b * n, s, s), v.reshape(b * n, s, d)).view(b, n, s, d)
        s = q @ k.transpose(-1, -2)
        if f in ("itruediv", "multi_query"):
            s /= d ** 0.5
        elif f == "tensor_scale":
            s = s * extra
        else:
            s = s * d ** -0.5
        if f == "full_fill":
            s = s.masked_fill(~extra, torch.full((), float("-inf")))
        elif f == "expand_as":
            s = s.masked_fill(extra.expand_as(s), float("-inf"))
        elif f == "bias_and_mask":
            s = s + extra[0]
            s = s + extra[1]
        elif f == "downcast":
            s = s.half()
        elif f == "upcast":
            s = s.float()
        elif f == "other_reader":
            s = s + s.sum()
        elif f == "mask_iadd":  # the add writes into the mask, not into the scores
            m = extra.clone()
            m += s
            s = m
        if f == "safe_softmax":
            p = torch.ops.aten._safe_softmax(s, -1)
        else:
            p = torch.softmax(s, dim=-1)
        if f == "clone":
            p = p.clone()
        if f in ("downcast", "upcast"):
            p = p.type_as(q)
        return p @ v


def _form_inputs(form, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shape = (2, 4, 8, 16)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    if form == "multi_query":
        k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
    keep = torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8)
    extra = {"tensor_scale": torch.tensor(0.25), "full_fill": keep, "expand_as": ~keep[:, :, :1],
             "bias_and_mask": (torch.randn(1, 4, 8, 8, generator=gen), torch.randn(2, 1, 1, 8, generator=gen)),
             "baddbmm": (torch.randn(8, 1, 8, generator=gen), keep),
             "baddbmm_beta2": (torch.randn(8, 1, 8, generator=gen), keep),
             "mask_iadd": torch.randn(2, 4, 8, 8, generator=gen)}.get(form)
    return (q, k, v) if extra is None else (q, k, v, extra)


NEW_FORMS = ["itruediv", "tensor_scale", "full_fill", "expand_as", "bias_and_mask", "clone",
             "safe_softmax", "baddbmm", "multi_query", "upcast"]


@pytest.mark.parametrize("form", NEW_FORMS)
def test_real_model_forms_fire_with_equal_outputs_and_grads(form):
    dtype = torch.float16 if form == "upcast" else torch.float32  # upcast: fp32 softmax of fp16
    model, args = Forms(form), _form_inputs(form, dtype)
    cap, sites = rewrite(model, args, "fuse_attention", front_end="dynamo", training=True)
    assert len(sites) == 1
    assert "scaled_dot_product_attention" in code(cap) and "softmax" not in code(cap)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    _check_same(model, cap, args, **tol)


@pytest.mark.parametrize("form,reason", [
    ("downcast", "casts the attention to torch.float16"),
    ("baddbmm_beta2", "beta 2.0"),
    ("other_reader", "has other users"),
    ("mask_iadd", "writes into the mask"),
])
def test_real_model_forms_declined_with_the_reason(form, reason):
    from rewriter.capture.front_ends import capture
    from rewriter.capture.ir import copy_graph_module
    from rewriter.devices.backends import CpuBackend
    from rewriter.pass_api import PassContext, registered_passes
    torch._dynamo.reset()
    model, args = Forms(form), _form_inputs(form)
    cap = capture(model, args, {}, "dynamo")
    cap(*args)
    ctx = PassContext(CpuBackend(), True)
    sites = [s for slot in cap.slots
             for s in registered_passes()["fuse_attention"].find(copy_graph_module(slot.kept), ctx)]
    assert sites == [] and any(reason in why for why in ctx.declined), ctx.declined


@pytest.mark.parametrize("form,fused", [("multi_query", True), ("full_fill", True),
                                        ("tensor_scale", True), ("baddbmm", False),
                                        ("bias_and_mask", False)])
def test_real_model_forms_on_the_npu_shim(fake_torch_npu, form, fused):
    """Multi-query k/v goes to the kernel with its one head (Nq % Nkv == 0, §1.1); a combined
    additive mask would need pse (declined)."""
    torch._dynamo.reset()
    model, args = Forms(form), _form_inputs(form)
    cap, sites = rewrite(model, args, "fuse_attention", front_end="dynamo", training=True,
                         backend=NpuBackend())
    assert len(sites) == int(fused)
    if fused:
        assert "npu_fusion_attention" in code(cap) and "expand" not in code(cap)
        _check_same(model, cap, args)


def test_a_message_logged_once_inside_forward_does_not_split_the_graph():
    """transformers' ``logger.warning_once`` (GPT-2's loss with loss_type=None) is a graph
    break for Dynamo, which then traces the model again from every frame above it."""
    import logging

    import transformers  # noqa: F401  (installs Logger.warning_once)
    logger = logging.getLogger("tests.once")

    class Logs(torch.nn.Module):
        def forward(self, q, k, v):
            scores = q @ k.transpose(-2, -1) / 4.0
            logger.warning_once("computing attention")
            return torch.softmax(scores, dim=-1) @ v
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    model = Logs()
    cap, sites = rewrite(model, (q, k, v), "fuse_attention", front_end="dynamo")
    assert len(cap.slots) == 1 and len(sites) == 1
    with torch.no_grad():
        torch.testing.assert_close(cap(q, k, v), model(q, k, v))
