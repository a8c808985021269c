"""cast_to_half (AMP in the graph), the user's half/fp32 lists, and fp16 loss scaling."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewriter
from rewriter.devices import amp
from rewriter.devices.backends import CpuBackend, NpuBackend
from tests.controlled import QUICK, Bf16Cpu, ControlledClock
from tests.models import HandAttention

HALF_FASTER = {"cast_to_half": 0.5}


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.attn = HandAttention("mul", d=d)
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.norm(x + self.attn(x).transpose(1, 2).reshape(x.shape))
        h = h + self.fc(h)
        return self.head(h).mean(1)


@pytest.fixture(autouse=True)
def restore_amp_lists():
    saved = (set(amp.HALF_OPS), set(amp.FLOAT_OPS), dict(amp.FORCED))
    yield
    amp.HALF_OPS.clear(), amp.HALF_OPS.update(saved[0])
    amp.FLOAT_OPS.clear(), amp.FLOAT_OPS.update(saved[1])
    amp.FORCED.clear(), amp.FORCED.update(saved[2])


def _opt(model, x, **kw):
    kw.setdefault("clock", ControlledClock(HALF_FASTER))
    kw.setdefault("device", Bf16Cpu())
    return rewriter.optimize(model, (x,), passes=["cast_to_half"], gate=QUICK, progress=False,
                             profile=False, **kw)


def _data():
    torch.manual_seed(0)
    return Block(), torch.randn(4, 16, 32)


def test_casts_fire_and_numerics_hold_at_bf16_tolerance():
    model, x = _data()
    fast = _opt(model.eval(), x, dtype=torch.bfloat16)
    d = fast.report.decisions[0]
    assert d.kept and any("linear" in s or "fc" in s for s in d.sites)
    src = fast.graph_code()["graph_0"]
    assert "to(torch.bfloat16)" in src and "to(torch.float32)" in src  # softmax/norm back to fp32
    with torch.no_grad():
        torch.testing.assert_close(fast(x).float(), model(x), rtol=1.6e-2, atol=2e-2)


def test_mm_written_as_a_function_or_a_method_runs_in_half_as_autocast_runs_it():
    class Mm(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.v = nn.Parameter(torch.randn(32, 8)), nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return torch.mm(x, self.w).mm(self.v)
    torch.manual_seed(0)
    model, x = Mm().eval(), torch.randn(16, 32)
    fast = _opt(model, x, dtype=torch.bfloat16)
    assert fast.report.decisions[0].kept and len(fast.report.decisions[0].sites) == 2
    src = fast.graph_code()["graph_0"]  # x cast; each weight cast once (inference)
    assert src.count("x.to(torch.bfloat16)") == 1 and src.count("= self.rewriter_weight_cast_bfloat16") == 2, src
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(fast(x).float(), expected, rtol=1.6e-2, atol=2e-2 * expected.abs().max().item())


def test_a_tensor_is_cast_once_per_dtype():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return x @ self.w + (x * 2) @ self.w
    fast = _opt(Shared().train(), torch.randn(4, 8), dtype=torch.bfloat16)
    src = fast.graph_code()["graph_0"]
    assert src.count("w.to(torch.bfloat16)") == 1  # one cast feeds both matmuls
    fast = _opt(Shared().eval(), torch.randn(4, 8), dtype=torch.bfloat16)
    src = fast.graph_code()["graph_0"]
    assert src.count("self.rewriter_weight_cast_bfloat16(w)") == 1 and "w.to(" not in src


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_inference_casts_each_weight_once_and_again_only_when_it_changes():
    """In inference a weight's half copy is made at the first call and reused (not cast at
    every call); an in-place update of the weight makes a new one; the user's weights stay fp32
    and the same tensors; a training graph casts as written (the gradient flows through it)."""
    torch.manual_seed(0)
    model, x = TwoLinear().eval(), torch.randn(8, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = _opt(model, x, dtype=torch.bfloat16)
    assert fast.report.kept_passes == ["cast_to_half"], fast.report.final
    held = 2 * sum(p.numel() for p in model.parameters())  # every weight and bias, in bf16
    assert any(f"{held / 2**10:.1f} KiB beside" in n for n in fast.report.notes), fast.report.notes
    src = fast.graph_code()["graph_0"]
    assert src.count("self.rewriter_weight_cast_bfloat16(") == 4  # two weights, two biases
    casts = []
    real_to = torch.Tensor.to
    weights = {p.data_ptr() for p in model.parameters()}

    def counting_to(self, *args, **kwargs):  # a weight's storage cast to bf16
        if self.data_ptr() in weights and torch.bfloat16 in args:
            casts.append(self.shape)
        return real_to(self, *args, **kwargs)
    with torch.no_grad():
        want = fast(x)
        torch.Tensor.to = counting_to
        try:
            for _ in range(3):
                torch.testing.assert_close(fast(x), want, rtol=0, atol=0)  # the same copies
            assert casts == []  # no weight was cast again
            model.a.weight.mul_(2.0)  # the user changes a weight in place
            changed = fast(x)
            assert casts == [model.a.weight.shape]  # that weight, and only it, cast again
        finally:
            torch.Tensor.to = real_to
        assert not torch.equal(changed, want)
        torch.testing.assert_close(changed.float(), model(x), rtol=3e-2, atol=3e-2)
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    model.a.weight.data.div_(2.0)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=1e-7)
    assert set(model.state_dict()) == set(before)


def test_a_weight_cast_is_as_written_under_autograd_and_its_copies_go_with_the_weight():
    import gc

    from rewriter.devices.weight_casts import WeightCast
    cast = WeightCast(torch.bfloat16)
    w = nn.Parameter(torch.randn(4, 4))
    with torch.no_grad():
        first = cast(w)
        assert cast(w) is first and first.dtype == torch.bfloat16 and not first.requires_grad
    grad_path = cast(w)  # autograd on: cast as written, the gradient reaches the weight
    assert grad_path is not first and grad_path.requires_grad
    grad_path.float().sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(4, 4))
    assert cast.cached_bytes() == 4 * 4 * 2 and not dict(cast.state_dict())
    del w, first, grad_path
    gc.collect()
    assert cast.cached_bytes() == 0  # the copy went with its weight


def test_not_applicable_without_dtype_and_declined_for_a_dtype_the_device_lacks():
    model, x = _data()
    assert _opt(model, x).report.decisions[0].status == "not applicable"
    # fp16 GEMMs are slow on this CPU: the CPU backend offers only bf16
    assert torch.float16 not in CpuBackend().amp_dtypes
    declined = _opt(model.eval(), x, dtype=torch.float16).report.decisions[0]
    assert declined.status == "not applicable" and "torch.float16 is not a fast autocast dtype on cpu" in declined.reason


def test_model_already_in_half_is_left_alone():
    model, x = _data()
    fast = _opt(model.to(torch.bfloat16).eval(), x.to(torch.bfloat16), dtype=torch.bfloat16)
    assert fast.report.decisions[0].status == "no sites"


def test_user_forces_an_op_to_fp32_and_sees_it_in_the_report():
    model, x = _data()
    amp.register_float_function(torch, "matmul")
    fast = _opt(model.eval(), x, dtype=torch.bfloat16)
    sites = fast.report.decisions[0].sites
    assert any("float32 (forced to float)" in s for s in sites)
    assert "(forced to float)" in fast.report.to_markdown()
    with pytest.raises(ValueError, match="no attribute"):
        amp.register_half_function(torch, "not_an_op")


def test_user_forces_an_op_to_half():
    model, x = _data()
    amp.register_half_function(torch.nn.functional, "softmax")
    fast = _opt(model.eval(), x, dtype=torch.bfloat16)
    assert any("softmax" in s and "forced to half" in s for s in fast.report.decisions[0].sites)


def test_npu_fp16_form_on_the_shim(fake_torch_npu):
    model, x = _data()
    fast = _opt(model.eval(), x, dtype=torch.float16, device=NpuBackend())
    assert fast.report.decisions[0].kept
    assert "to(torch.float16)" in fast.graph_code()["graph_0"]


def test_twenty_training_steps_track_the_fp32_loss_curve():
    model, x = _data()
    y = torch.randint(0, 10, (4,))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fast, opt = rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda o: F.cross_entropy(o.float(), y),
                                  dtype=torch.bfloat16, passes=["cast_to_half"], device=Bf16Cpu(),
                                  clock=ControlledClock(HALF_FASTER), gate=QUICK, progress=False, profile=False)
    assert fast.report.kept_passes[:1] == ["cast_to_half"]
    for step in range(20):
        loss = F.cross_entropy(fast(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # bf16 keeps 8 bits of mantissa: the two curves may part by about 1.6e-2 relative
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1.6e-2, atol=1e-2,
                                   msg=lambda m: f"step {step}: {m}")


class _Fp16Cpu(CpuBackend):
    amp_dtypes = (torch.float16, torch.bfloat16)  # lets the fp16 path run on this CPU


def test_fp16_loss_scaling_skips_an_overflow_step_and_backs_off():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, opt = rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda o: o.float().mean(),
                                  dtype=torch.float16, device=_Fp16Cpu(), passes=["cast_to_half"],
                                  clock=ControlledClock(HALF_FASTER), gate=QUICK, progress=False, profile=False)
    scaler = fast._outcome.loss_scale
    assert scaler is not None and scaler.scale == 2.0 ** 16
    scaler.scale = 2.0 ** 4  # a scale this small model's fp16 gradients take without overflow
    before = [p.detach().clone() for p in model.parameters()]
    fast(x).float().mean().backward()  # an ordinary step: gradients scaled, then unscaled
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    ref = copy.deepcopy(model)
    assert all(torch.isfinite(g).all() for g in grads) and scaler.skipped_steps == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    (fast(x).float().mean() * 1e10).backward()  # a gradient fp16 cannot hold
    opt.step()
    assert scaler.skipped_steps == 1 and scaler.scale == 2.0 ** 3
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_a_weight_cast_traced_by_make_fx_is_a_cast_in_the_graph_not_a_copy_of_ours(mode):
    """AOTAutograd (what Inductor is handed) traces with make_fx: a cached copy returned there
    would be baked into the graph as a constant, stale once the weight changes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from rewriter.devices.weight_casts import WeightCast
    cast = WeightCast(torch.bfloat16)
    w = nn.Parameter(torch.randn(4, 4))
    with torch.no_grad():
        gm = make_fx(lambda t: cast(t) * 2, tracing_mode=mode)(w)
    code = gm.code
    assert "_to_copy" in code and "_tensor_constant" not in code, code
    assert cast.cached_bytes() == 0


class RotaryFromPositions(nn.Module):
    """transformers' rotary angles before 5.2x: ``inv_freq @ positions.float()``, written inside
    ``torch.autocast(enabled=False)`` (no trace of it in a graph captured without autocast)."""

    def __init__(self, d=32):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, _ = x.shape
        positions = torch.arange(s, device=x.device)[None].expand(b, -1)
        angles = (self.inv_freq[None, :, None].expand(b, -1, 1).float() @ positions[:, None, :].float())
        angles = torch.cat((angles, angles), dim=1).transpose(1, 2)
        return self.proj(x) * angles.cos() + x * angles.sin()


def test_an_op_on_integer_values_held_as_floats_stays_fp32():
    """Positions above 256 are not exact in bf16: the angles' matmul keeps fp32 (the linear is
    cast), and the result holds at bf16 tolerance."""
    torch.manual_seed(0)
    model, x = RotaryFromPositions().eval(), torch.randn(2, 600, 32)
    fast = _opt(model, x, dtype=torch.bfloat16)
    d = fast.report.decisions[0]
    assert d.kept, d.reason
    # sites are named by their node: "linear: bfloat16"; the matmul's node is "angles"
    assert any(s.startswith("linear") for s in d.sites) and not any(s.startswith("angles") for s in d.sites), d.sites
    with torch.no_grad():
        torch.testing.assert_close(fast(x).float(), model(x), rtol=1.6e-2, atol=3e-2)
        # the control: the same matmul in bf16 is far off (the rule is what keeps it right)
        b, s, _ = x.shape
        positions = torch.arange(s)[None].expand(b, -1)
        half = (model.inv_freq[None, :, None].expand(b, -1, 1).bfloat16() @ positions[:, None, :].bfloat16())
        exact = model.inv_freq[None, :, None].expand(b, -1, 1) @ positions[:, None, :].float()
        assert (half.float().cos() - exact.cos()).abs().max() > 0.5


def test_in_a_region_graph_an_fp32_op_casts_its_inputs_which_may_arrive_half():
    """A region measured under the precision overlay gets its inputs as the overlaid model makes
    them (an LM head's bf16 logits into the loss): the loss casts them to fp32 there as it does
    in the model, so the region's original form is not timed running the loss in bf16. In the
    whole graph a placeholder's dtype is the model input's own: no cast."""
    from passes.cast_to_half import CastToHalf
    from rewriter.capture.front_ends import capture
    from rewriter.capture.ir import copy_graph_module
    from rewriter.pass_api import PassContext

    class Loss(torch.nn.Module):
        def forward(self, logits, target):
            return F.cross_entropy(logits, target)

    kwargs = {"logits": torch.randn(6, 10), "target": torch.randint(0, 10, (6,))}
    cap = capture(Loss(), (), kwargs, "auto")
    cap(**kwargs)
    gm = cap.slots[0].original
    p = CastToHalf()
    for region, casts in ((True, 1), (False, 0)):
        ctx = PassContext(Bf16Cpu(), True, dtype=torch.bfloat16, region=region)
        sites = p.find(copy_graph_module(gm), ctx)
        assert sum(len(s.match[1]) for s in sites) == casts, (region, sites)


@pytest.mark.parametrize("tight", [True, False])
def test_under_a_tight_budget_the_precision_pass_is_decided_first_and_the_others_in_it(monkeypatch, tight):
    """With fewer than PRECISION_FIRST_STEPS steps' time left, the precision pass (the largest
    saving, the dearest pairs) is decided before the graph passes, which then run in it; with
    time to spare, the others first, in it speculatively, then the precision on the whole step."""
    from rewriter import pipeline

    order = []
    decide_each = pipeline.Run._decide_each

    def spy(self, passes):
        order.append([p.name for p in passes])
        return decide_each(self, passes)
    monkeypatch.setattr(pipeline.Run, "_decide_each", spy)
    monkeypatch.setattr(pipeline, "PRECISION_FIRST_STEPS", 10**9 if tight else 0)
    model, x = _data()
    fast = rewriter.optimize(model.eval(), (x,), passes=["cast_to_half", "fuse_attention"], gate=QUICK,
                             clock=ControlledClock(HALF_FASTER), device=Bf16Cpu(), dtype=torch.bfloat16,
                             progress=False, profile=False, knowledge_base=False, time_budget=600)
    assert "cast_to_half" in fast.report.kept_passes
    others = [names for names in order if "fuse_attention" in names]
    assert order.index(["cast_to_half"]) < order.index(others[0]) if tight else \
        order.index(others[0]) < order.index(["cast_to_half"])
    attention = next(d for d in fast.report.decisions if d.pass_name == "fuse_attention")
    assert attention.status not in ("not reached", "not tried"), attention.reason
