"""Fused optimizers: same algorithm and state, fewer kernels; gated like any rewrite."""
import copy

import pytest
import torch
import torch.nn.functional as F

import rewriter
from rewriter.devices.backends import CpuBackend, NpuBackend
from rewriter.devices.optimizers import candidates
from tests.controlled import QUICK, ControlledClock
from tests.models import ReluMLP

FUSED_FASTER = {"fuse_optimizer": 0.25}


def _setup(opt_cls=torch.optim.AdamW, **opt_kw):
    torch.manual_seed(0)
    model = ReluMLP().train()
    opt = opt_cls(model.parameters(), lr=1e-2, **opt_kw)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    return model, opt, x, y


def _optimize(model, opt, x, y, costs=FUSED_FASTER, **kw):
    return rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda out: F.mse_loss(out, y),
                             passes=[], clock=ControlledClock(costs), gate=QUICK, progress=False,
                             profile=False, **kw)


def _train(model, opt, x, y, steps):
    for _ in range(steps):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_adamw_comes_back_fused_in_place_with_the_measured_speedup():
    model, opt, x, y = _setup(foreach=False)
    fast, opt2 = _optimize(model, opt, x, y)
    assert opt2 is opt and all(g["fused"] for g in opt.param_groups)
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_optimizer")
    assert d.kept and d.speedup == pytest.approx(4.0, rel=0.05) and "fused=True" in d.reason
    assert "fuse_optimizer" in fast.report.kept_passes


def test_five_steps_match_the_original_optimizer():
    model, opt, x, y = _setup(foreach=False)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    fast, opt = _optimize(model, opt, x, y)
    _train(fast, opt, x, y, 5)
    _train(ref_model, ref_opt, x, y, 5)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_existing_state_carries_over_and_state_dict_round_trips():
    model, opt, x, y = _setup(foreach=False)
    _train(model, opt, x, y, 2)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    fast, opt = _optimize(model, opt, x, y)
    for p, st in opt.state.items():
        torch.testing.assert_close(st["exp_avg"], before[id(p)]["exp_avg"], rtol=0, atol=0)
    saved = opt.state_dict()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(saved)
    opt.load_state_dict(fresh.state_dict())
    _train(fast, opt, x, y, 1)


def test_scheduler_made_before_optimize_still_drives_the_optimizer():
    model, opt, x, y = _setup(foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fast, opt2 = _optimize(model, opt, x, y)
    _train(fast, opt2, x, y, 1)
    sched.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_slower_fused_form_is_rejected_and_optimizer_left_as_is():
    model, opt, x, y = _setup(torch.optim.RMSprop)
    fast, opt2 = _optimize(model, opt, x, y, costs={"fuse_optimizer": 2.0})
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_optimizer")
    assert not d.kept and "slower" in d.reason and "foreach=True" in d.reason
    assert opt2 is opt and not opt.param_groups[0]["foreach"]


def test_optimizer_without_fused_form_is_left_alone_with_a_reason():
    model, opt, x, y = _setup(torch.optim.LBFGS)
    found, reason = candidates(opt, CpuBackend())
    assert found == [] and "LBFGS" in reason

    class Custom(torch.optim.SGD):
        pass
    Custom.__module__ = "my_project.optim"
    found, reason = candidates(Custom(model.parameters(), lr=0.1), CpuBackend())
    assert found == [] and "not a torch.optim optimizer" in reason
    model, opt, x, y = _setup(torch.optim.SGD)
    found, _ = candidates(opt, CpuBackend())
    assert "fused=True" in found[0].description


def test_npu_mapping_on_the_shim(fake_torch_npu):
    model, opt, x, y = _setup(torch.optim.AdamW, weight_decay=0.05, betas=(0.8, 0.99))
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05, betas=(0.8, 0.99))
    fast, opt2 = _optimize(model, opt, x, y, device=NpuBackend())
    assert isinstance(opt2, fake_torch_npu.optim.NpuFusedAdamW)
    assert opt2.param_groups is opt.param_groups
    assert opt2.param_groups[0]["betas"] == (0.8, 0.99) and opt2.param_groups[0]["weight_decay"] == 0.05
    for _ in range(5):
        F.mse_loss(fast(x), y).backward()
        rewriter.clip_grad_norm_(model.parameters(), 10.0, optimizer=opt2)
        opt2.step()
        rewriter.zero_grad(opt2)  # set_to_none=False for the NPU fused optimizer
        F.mse_loss(ref_model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 10.0)
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_npu_fused_refuses_bf16_params_so_none_is_offered(fake_torch_npu):
    model, opt, x, y = _setup(torch.optim.AdamW)
    model.to(torch.bfloat16)
    found, reason = candidates(opt, NpuBackend())
    assert found == [] and "fp32/fp16 parameters only, not torch.bfloat16" in reason


def test_clip_grad_norm_matches_torch():
    model, opt, x, y = _setup()
    F.mse_loss(model(x), y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    total = rewriter.clip_grad_norm_(model.parameters(), 0.1)
    expected = torch.nn.utils.get_total_norm(ref)
    torch.testing.assert_close(total, expected)
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) <= 0.1 + 1e-6
