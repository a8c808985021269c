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


def test_a_capped_scratch_copy_takes_each_large_parameter_s_first_rows_and_its_state_s():
    from rewriter.devices.optimizers import scratch_copy
    big, small = torch.nn.Parameter(torch.randn(100, 30)), torch.nn.Parameter(torch.randn(7))
    opt = torch.optim.AdamW([big, small])
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    opt.step()  # state: step, exp_avg, exp_avg_sq of each parameter's shape
    before = {k: v.clone() for k, v in opt.state[big].items()}
    groups, state, clones = scratch_copy(opt, max_numel=100)
    c_big, c_small = clones
    assert c_big.shape == (4, 30) and torch.equal(c_big, big[:4])  # ceil(100 / 30) rows
    assert c_small.shape == (7,) and c_small is not small
    assert torch.equal(state[c_big]["exp_avg"], opt.state[big]["exp_avg"][:4])
    assert torch.equal(state[c_big]["step"], opt.state[big]["step"])
    with torch.no_grad():
        c_big.add_(1.0)
    state[c_big]["exp_avg"].add_(1.0)  # copies: the user's parameter and state stay
    assert all(torch.equal(opt.state[big][k], v) for k, v in before.items())
    assert not torch.equal(c_big, big[:4])


def test_a_parameter_whose_state_has_another_shape_is_copied_whole():
    from rewriter.devices.optimizers import scratch_copy
    p = torch.nn.Parameter(torch.randn(64, 8))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"row_factor": torch.ones(64), "col_factor": torch.ones(8)}  # factored moments
    _, state, (c,) = scratch_copy(opt, max_numel=16)
    assert c.shape == p.shape and state[c]["row_factor"].shape == (64,)


def test_the_numerics_check_runs_on_capped_copies_and_still_catches_a_wrong_update(monkeypatch):
    from rewriter.decide import optimizer_gate
    from rewriter.devices import optimizers
    monkeypatch.setattr(optimizer_gate, "NUMERICS_MAX_NUMEL", 32)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50, 16))
    opt = torch.optim.AdamW([p], lr=1e-2, foreach=False)
    sizes = []
    real = optimizers.scratch_copy

    def spy(optimizer, seed=0, only=None, max_numel=None):
        out = real(optimizer, seed, only, max_numel)
        sizes.append(out[2][0].shape)
        return out
    monkeypatch.setattr(optimizers, "scratch_copy", spy)
    fused = next(c for c in candidates(opt, CpuBackend())[0] if c.flags and c.flags.get("fused"))
    ok, detail, _ = optimizer_gate.optimizer_numerics(opt, fused)
    assert ok, detail
    assert sizes == [(2, 16), (2, 16)]  # the first ceil(32 / 16) rows, both sides
    # a fused form with another learning rate: the capped rows still disagree
    lr_off = optimizers.OptimizerCandidate("AdamW, lr x 2", factory=lambda groups: torch.optim.AdamW(
        [{**g, "lr": g["lr"] * 2} for g in groups]))
    ok, detail, _ = optimizer_gate.optimizer_numerics(opt, lr_off)
    assert not ok and "param 0" in detail


def test_the_numerics_check_holds_the_update_not_the_parameter_to_the_bar():
    """A fused kernel's step size rounds in fp32 (Adam's bias correction: ~1e-5 of the update):
    that passes on a bias that starts at zero, where the update is the whole value (the old
    bar, 1e-5 of the parameter, failed it); a step size 1e-3 off fails on the weights."""
    from rewriter.decide import optimizer_gate
    from rewriter.devices import optimizers
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(64, 32) * 0.02), torch.nn.Parameter(torch.zeros(64))
    opt = torch.optim.AdamW([weight, bias], lr=1e-4, foreach=False)

    def lr_times(f: float) -> optimizers.OptimizerCandidate:
        return optimizers.OptimizerCandidate(f"AdamW, lr x {f}", factory=lambda groups: torch.optim.AdamW(
            [{**g, "lr": g["lr"] * f} for g in groups]))
    ok, detail, _ = optimizer_gate.optimizer_numerics(opt, lr_times(1 + 3e-5))
    assert ok, detail
    ok, detail, _ = optimizer_gate.optimizer_numerics(opt, lr_times(1 + 1e-3))
    assert not ok and "elements off" in detail, detail
