"""The graph compiler as a gated candidate (optimize(compile=...)).

Decisions are made with a controlled clock (tests/controlled.py): the compiled variant's step
carries the name "compile", so ``ControlledClock({"compile": 0.5})`` makes it twice as fast.
The compiler is a fake torch.compile backend (it runs the graph as it is, or raises, or
changes the numerics); one test compiles for real with Inductor, on a tiny model.
"""
import dataclasses
import math
import os
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewriter
from rewriter.decide import compile_gate
from rewriter import GateSettings
from rewriter.decide import amortize
from rewriter.decide.amortize import (MIN_BUDGET, PAID_MEASURE_SHARE, REPAY_FRACTION, Payback,
                                      deciding_budget, measuring_paid, predict_compile_seconds)
from rewriter.devices.backends import get_backend
from rewriter.devices.compile_cache import is_warm, use_persistent_cache
from rewriter.devices.executors import executors_for
from tests import npu_shim
from tests.controlled import QUICK, Bf16Cpu, ControlledClock, RewriteRelu
from tests.models import ReluMLP, TwoLayers


class FakeCompiler:
    """A torch.compile backend that runs each graph as it is and counts compiles and calls;
    ``shift`` changes the outputs (a miscompile), ``fail`` raises while compiling."""

    __name__ = "fake"

    def __init__(self, shift: float = 0.0, fail: bool = False):
        self.shift, self.fail = shift, fail
        self.compiles = self.calls = 0

    def __call__(self, gm, example_inputs):
        if self.fail:
            raise RuntimeError("backend exploded")
        self.compiles += 1

        def run(*args):
            self.calls += 1
            out = gm(*args)
            if self.shift:
                out = torch.utils._pytree.tree_map(
                    lambda t: t + self.shift if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
            return out
        return run


def _opt(model, inputs, clock, compile, **kw):
    kw.setdefault("knowledge_base", False)
    kw.setdefault("gate", QUICK)
    return rewriter.optimize(model, inputs, clock=clock, profile=False, progress=False,
                             compile=compile, **kw)


def _compile_row(fast, original=False):
    """The compile row of the rewritten model (or of the original model compiled beside it)."""
    rows = [d for d in fast.report.decisions if d.pass_name == "compile"
            and any("(original model" in s for s in d.sites) == original]
    assert len(rows) == 1, [(d.pass_name, d.sites) for d in fast.report.decisions]
    return rows[0]


def _compiled_samples(clock):
    return sum(1 for passes in clock.seen if "compile" in passes)


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return ReluMLP().eval(), torch.randn(8, 16)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_a_faster_compile_is_kept_on_top_of_the_kept_rewrites_and_runs(mlp, front_end):
    model, x = mlp
    fake = FakeCompiler()
    fast = _opt(model, (x,), ControlledClock({"a": 0.5, "compile": 0.5}), fake,
                passes=[RewriteRelu("a")], front_end=front_end)
    d = _compile_row(fast)
    assert d.kept and d.status == "kept" and d.scope == "step" and d.speedup == pytest.approx(2.0, rel=0.05)
    assert "a" in fast.report.kept_passes and fast.report.final["compiled"] == "fake"
    assert d.measurement["compile_seconds"] >= 0 and "compile" in fast.report.phases
    assert fast.report.plan["compile"] == {"executor": "fake", "kept": True}
    before = fake.calls
    torch.testing.assert_close(fast(x), model(x))
    assert fake.calls > before  # the compiled graph is what runs


def test_the_compile_is_measured_after_one_warm_up_round(mlp, monkeypatch):
    """Both steps have run warm before (the compiled one in its compile and verification): one
    untimed round of each, then the pairs."""
    import dataclasses as dc

    from rewriter.decide import compile_gate
    counts = []
    real = compile_gate.measure

    def counted(baseline, candidate, **kw):
        n = {"runs": 0}

        def run():
            n["runs"] += 1
            candidate.run()
        m = real(baseline, dc.replace(candidate, run=run), **kw)
        counts.append(n["runs"] - len(m.candidate_times))  # the untimed ones
        return m
    monkeypatch.setattr(compile_gate, "measure", counted)
    model, x = mlp
    _opt(model, (x,), ControlledClock({"a": 0.5, "compile": 0.5}), FakeCompiler(), passes=[RewriteRelu("a")],
         gate=dc.replace(QUICK, warmup=2, warmup_seconds=10.0, max_warmup=10))
    assert counts and all(c == 1 for c in counts), counts  # each compile candidate's


def test_a_slower_compile_is_rejected_and_the_eager_graphs_run(mlp):
    model, x = mlp
    fake = FakeCompiler()
    fast = _opt(model, (x,), ControlledClock({"a": 0.5, "compile": 1.6}), fake, passes=[RewriteRelu("a")])
    d = _compile_row(fast)
    assert not d.kept and d.status == "rejected" and d.reason.startswith("fake, whole step: slower")
    assert fast.report.plan["compile"] == {"executor": "fake", "kept": False}
    before = fake.calls
    torch.testing.assert_close(fast(x), model(x))
    assert fake.calls == before and fast.report.kept_passes == ["a"]


def test_the_progress_says_a_compile_is_starting_and_about_how_long_it_takes(mlp, caplog):
    import logging
    model, x = mlp
    with caplog.at_level(logging.INFO, logger="rewriter.progress"):
        _opt(model, (x,), ControlledClock({"a": 0.5, "compile": 0.5}), FakeCompiler(),
             passes=[RewriteRelu("a")])
    lines = [r.getMessage() for r in caplog.records if r.name == "rewriter.progress"]
    starting = [i for i, m in enumerate(lines) if m.startswith("rewriter: compile (fake): compiling, about")]
    decided = [i for i, m in enumerate(lines) if m.startswith("rewriter: compile (fake): kept")]
    assert len(starting) == 1 and decided and starting[0] < decided[0], lines
    assert "predicted from" in lines[starting[0]] and "graph nodes" in lines[starting[0]]


def test_a_compile_within_noise_is_not_kept(mlp):
    model, x = mlp
    fast = _opt(model, (x,), ControlledClock({"compile": 1.0}, jitter=0.05), FakeCompiler())
    assert not _compile_row(fast).kept


@pytest.mark.parametrize("speedup, kept", [(1.035, True), (1.015, False)])
def test_a_compile_is_kept_past_half_the_region_margin(mlp, speedup, kept):
    # measured as the step itself and weighed by its payback: 1.025 for the default 1.05
    model, x = mlp
    assert compile_gate.compile_margin(1.05) == pytest.approx(1.025)
    fast = _opt(model, (x,), ControlledClock({"compile": 1 / speedup}, jitter=0.001), FakeCompiler())
    d = _compile_row(fast)
    assert d.kept is kept and d.speedup == pytest.approx(speedup, rel=0.005), d.reason


def test_a_compile_that_raises_is_reported_and_the_eager_graphs_run(mlp):
    model, x = mlp
    clock = ControlledClock({"a": 0.5, "compile": 0.5})
    fast = _opt(model, (x,), clock, FakeCompiler(fail=True), passes=[RewriteRelu("a")])
    d = _compile_row(fast)
    assert not d.kept and d.status == "raised" and "backend exploded" in d.reason
    assert "eager graphs run" in d.reason and _compiled_samples(clock) == 0
    assert fast.report.kept_passes == ["a"]
    torch.testing.assert_close(fast(x), model(x))


def test_a_compile_that_changes_numerics_is_rejected(mlp):
    model, x = mlp
    clock = ControlledClock({"compile": 0.5})
    fast = _opt(model, (x,), clock, FakeCompiler(shift=1e-2))
    d = _compile_row(fast)
    assert not d.kept and d.status == "failed verification" and _compiled_samples(clock) == 0
    torch.testing.assert_close(fast(x), model(x))


def test_training_compile_is_measured_on_forward_backward_and_optimizer_step(mlp):
    model, x = mlp
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fake = FakeCompiler()
    fast, opt2 = _opt(model, (x,), ControlledClock({"compile": 0.5, "fuse_optimizer": 0.5}), fake,
                      optimizer=opt, loss_fn=lambda out: out.square().mean(), passes=[])
    d = _compile_row(fast)
    assert d.kept and fast.report.mode == "training"
    # measured with the fused optimizer kept before it: both variants' steps contain it
    assert any(n.startswith("optimizer:") for n in fast.report.notes)
    before = fake.calls
    fast(x).square().mean().backward()
    opt2.step()
    assert fake.calls > before


def test_replay_from_plan_compiles_without_measuring(mlp):
    model, x = mlp
    first = _opt(model, (x,), ControlledClock({"compile": 0.5}), FakeCompiler(), passes=[])
    plan = first.report.plan
    assert plan["compile"]["kept"]
    clock, fake = ControlledClock({"compile": 0.5}), FakeCompiler()
    again = _opt(model, (x,), clock, fake, passes=[], plan=plan)
    d = _compile_row(again)
    assert d.kept and d.status == "replayed" and "not measured" in d.reason
    assert clock.calls == 0 and fake.compiles >= 1
    torch.testing.assert_close(again(x), model(x))
    off = _opt(model, (x,), ControlledClock(), False, passes=[], plan=plan)
    assert not [d for d in off.report.decisions if d.pass_name == "compile"]


def test_the_knowledge_base_keeps_the_decision_so_a_second_run_does_not_measure(mlp, tmp_path):
    model, x = mlp
    kb = tmp_path / "kb.json"
    _opt(model, (x,), ControlledClock({"compile": 0.5}), FakeCompiler(), knowledge_base=kb)
    clock = ControlledClock({"compile": 3.0})  # would be rejected if it were measured
    again = _opt(model, (x,), clock, FakeCompiler(), knowledge_base=kb)
    d = _compile_row(again)
    assert d.kept and "knowledge base" in d.reason and _compiled_samples(clock) == 0
    # no rewrite was kept: the original model, compiled, runs, and the report says so
    assert again.report.kept_passes == ["compile"] and "compiled with fake" in again.report.final["reason"]


def test_a_model_with_the_same_ops_and_other_widths_is_measured_not_taken_from_the_knowledge_base(tmp_path):
    torch.manual_seed(0)
    kb, x = tmp_path / "kb.json", torch.randn(8, 16)
    _opt(TwoLayers(32).eval(), (x,), ControlledClock({"compile": 0.5}), FakeCompiler(), knowledge_base=kb)
    clock = ControlledClock({"compile": 3.0})
    wider = _opt(TwoLayers(64).eval(), (x,), clock, FakeCompiler(), knowledge_base=kb)
    d = _compile_row(wider)
    assert not d.kept and "knowledge base" not in d.reason and _compiled_samples(clock) > 0


def test_auto_does_not_pay_a_compile_the_run_cannot_repay_and_false_does_not_try(mlp):
    model, x = mlp  # a step of well under a second: no compile repays within 100 steps
    clock = ControlledClock()
    fast = _opt(model, (x,), clock, "auto", steps=100)
    d = _compile_row(fast)
    assert not d.kept and d.status == "not tried" and "would not repay" in d.reason
    m = d.measurement
    assert m["steps"] == 100 and m["predicted_compile_seconds"] > 1 and m["nodes"] > 0
    assert m["break_even_step"] > REPAY_FRACTION * 100 and m["repays"] is False
    assert "compile" not in fast.report.phases and _compiled_samples(clock) == 0  # never compiled
    off = _opt(model, (x,), ControlledClock(), False)
    assert not [d for d in off.report.decisions if d.pass_name == "compile"]


class SlowCompiler(FakeCompiler):
    """A fake compiler whose compile takes ``seconds`` (a one-time cost of known size)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def __call__(self, gm, example_inputs):
        time.sleep(self.seconds)
        return super().__call__(gm, example_inputs)


@pytest.mark.parametrize("share, kept", [(0.0, False), (PAID_MEASURE_SHARE, True)])
def test_a_paid_compile_near_the_margin_is_measured_on_for_a_share_of_its_seconds(mlp, monkeypatch,
                                                                                    share, kept):
    """Truly 1.08x, samples +-15 %: the gate's budget of one comparison (here none: its fewest
    pairs) leaves it within noise; a compile that cost 1 s buys 0.5 s of pairs, enough to see it
    faster (share 0: the budget as before)."""
    monkeypatch.setattr(amortize, "PAID_MEASURE_SHARE", share)
    model, x = mlp
    g = dataclasses.replace(QUICK, max_pairs=200, budget_seconds=0.0)
    fast = _opt(model, (x,), ControlledClock({"compile": 1 / 1.08}, jitter=0.15), SlowCompiler(1.0),
                passes=[], gate=g)
    d = _compile_row(fast)
    assert d.kept is kept, d.reason
    if kept:
        assert d.measurement["pairs"] > 10 * g.min_pairs and d.speedup == pytest.approx(1.08, abs=0.04)
    else:
        assert "within noise" in d.reason and d.measurement["pairs"] == g.min_pairs


def test_measuring_paid_extends_only_past_the_gates_own_budget():
    g = GateSettings(budget_seconds=4.0)
    assert measuring_paid(g, 20.0).budget_seconds == pytest.approx(PAID_MEASURE_SHARE * 20.0)
    assert measuring_paid(g, 2.0).budget_seconds == 4.0


def test_a_faster_compile_that_does_not_repay_within_the_run_is_not_kept(mlp):
    model, x = mlp
    # twice as fast on a 10 ms step saves 5 ms a step; 0.3 s of compile needs 60 steps
    fast = _opt(model, (x,), ControlledClock({"compile": 0.5}), SlowCompiler(0.3), steps=50)
    d = _compile_row(fast)
    assert not d.kept and d.status == "rejected" and "does not repay within the run" in d.reason
    assert d.measurement["break_even_step"] >= 60 and d.measurement["steps"] == 50
    assert d.measurement["repays_in_run"] is False
    assert fast.report.plan["compile"] == {"executor": "fake", "kept": False}


def test_a_paid_compile_that_repays_within_the_run_but_not_its_first_tenth_is_kept(mlp):
    """Once compiled and measured faster, the cost is sunk: kept when it repays in the run."""
    model, x = mlp
    fast = _opt(model, (x,), ControlledClock({"compile": 0.5}), SlowCompiler(0.3), steps=100)
    d = _compile_row(fast)
    m = d.measurement
    assert REPAY_FRACTION * 100 < m["break_even_step"] <= 100  # ~60 steps of the 100
    assert d.kept and m["repays"] is False and m["repays_in_run"] is True
    assert "within the run's steps=100" in d.reason


def test_a_faster_compile_that_repays_early_in_a_long_run_is_kept_and_says_when(mlp):
    model, x = mlp
    fast = _opt(model, (x,), ControlledClock({"compile": 0.5}), SlowCompiler(0.3), steps=100_000)
    d = _compile_row(fast)
    assert d.kept and d.measurement["repays"] is True
    assert 60 <= d.measurement["break_even_step"] <= REPAY_FRACTION * 100_000
    assert "repaid after" in d.reason


def test_without_steps_an_asked_for_compile_is_kept_on_speed_alone(mlp):
    model, x = mlp  # compile=<backend> and no steps: the one-time cost is the user's call
    fast = _opt(model, (x,), ControlledClock({"compile": 0.5}), SlowCompiler(0.3))
    d = _compile_row(fast)
    assert d.kept and "break_even_step" not in d.measurement


def test_steps_must_be_a_positive_int(mlp):
    model, x = mlp
    for bad in (0, -5, 2.5, True, "100"):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            rewriter.optimize(model, (x,), steps=bad, progress=False)


def test_payback_arithmetic():
    p = Payback(cost_s=20.0, saving_s=0.030, steps=20_000)
    assert math.ceil(p.break_even) == 667 and p.repays
    assert not Payback(20.0, 0.030, 100).repays
    assert not Payback(20.0, 0.009, 20_000).repays and Payback(20.0, 0.009, 20_000).repays_in_run
    assert Payback(1.0, 0.0, 10**9).break_even == math.inf and not Payback(1.0, -0.1, 10).repays
    assert p.to_dict()["break_even_step"] == 667 and "after 667 steps" in p.describe()
    assert Payback(1.0, 0.0, 10).to_dict()["break_even_step"] is None


def test_compile_seconds_are_predicted_from_the_knowledge_base_when_it_has_them():
    fit = predict_compile_seconds(100, training=True)
    assert fit > predict_compile_seconds(10, training=True) > 0  # more nodes, more seconds
    assert predict_compile_seconds(100, True, known_s=30.0) == 30.0
    assert predict_compile_seconds(100, True, known_s=30.0, warm=True) < 30.0


def test_inductor_caches_go_beside_the_knowledge_base_unless_a_folder_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # restored after the test, as it was
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_persistent_cache(None) is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    where = use_persistent_cache(str(tmp_path / "kb" / "knowledge_base.json"))
    assert where == str(tmp_path / "kb" / "inductor") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert not is_warm(where)
    (tmp_path / "kb" / "inductor").mkdir(parents=True)
    (tmp_path / "kb" / "inductor" / "fxgraph").mkdir()
    assert is_warm(where)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_persistent_cache(str(tmp_path / "kb" / "knowledge_base.json")) == str(tmp_path / "mine")
    # torch writes its own default into the variable at import: that is no choice of the user's
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_persistent_cache(str(tmp_path / "kb" / "knowledge_base.json")) == where


def test_bad_compile_argument_is_a_clear_error(mlp):
    model, x = mlp
    with pytest.raises(ValueError, match="compile must be"):
        rewriter.optimize(model, (x,), compile="turbo", progress=False)


# --- executors per device -----------------------------------------------------------------------
def test_cpu_has_inductor():
    found, declined = executors_for(get_backend("cpu"))
    assert [e.name for e in found] == ["inductor"] and declined == []


def test_npu_executors_are_declined_with_reasons_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    found, declined = executors_for(get_backend("npu"))
    assert found == [] and len(declined) == 4
    assert all("torch_npu does not import" in why for why in declined)


def test_npu_executors_need_a_release_with_torch_compile(emulate):
    emulate(version=npu_shim.OLDEST_VERSION)  # TorchNPU 6.0.0
    found, declined = executors_for(get_backend("npu"))
    assert found == [] and all("predates torch.compile" in why for why in declined)


def test_npu_executors_on_a_recent_torch_npu_are_tried_where_registered(emulate, monkeypatch):
    emulate()  # TorchNPU 26.1.0; the shim registers no torch.compile backend, nor triton
    found, declined = executors_for(get_backend("npu"), training=True)
    reasons = dict(why.split(": ", 1) for why in declined)
    assert found == []
    assert "triton-ascend" in reasons["inductor"]
    assert "does not register" in reasons["npugraph_ex"] and "does not register" in reasons["npugraphs"]
    assert "inference-oriented" in reasons["torchair"]
    _, declined = executors_for(get_backend("npu"), training=False)
    assert "torchair does not import" in dict(w.split(": ", 1) for w in declined)["torchair"]
    real = torch._dynamo.list_backends
    monkeypatch.setattr(torch._dynamo, "list_backends",
                        lambda exclude_tags=(): sorted(real(exclude_tags) + ["npugraphs"]))
    found, _ = executors_for(get_backend("npu"))
    assert [e.name for e in found] == ["npugraphs"]
    with pytest.raises(ValueError, match="no such executor"):
        executors_for(get_backend("npu"), "nvfuser")


def test_a_real_inductor_compile_is_verified_and_kept_when_faster():
    """The one real compile of this file: Inductor on a tiny inference model."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval(), torch.randn(4, 8)
    fast = _opt(model, (x,), ControlledClock({"compile": 0.5}), True, passes=[])
    d = _compile_row(fast)
    assert d.kept and d.sites == ["inductor"], d.reason
    assert d.max_abs_error is not None and d.measurement["compile_seconds"] > 0
    torch.testing.assert_close(fast(x), model(x))


def test_a_training_graph_with_dropout_is_verified_with_dropout_off():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4)).train()
    x = torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fake = FakeCompiler()
    fast, _ = _opt(model, (x,), ControlledClock({"compile": 0.5}), fake, optimizer=opt,
                   loss_fn=lambda out: out.sum(), passes=[])
    d = _compile_row(fast)
    assert d.kept, d.reason  # the compile with dropout off matched the reference
    assert fake.compiles >= 2  # the graph that runs, and the one verified without dropout


def test_with_dtype_the_compiled_form_is_the_half_precision_graph():
    torch.manual_seed(0)
    model, x = ReluMLP().eval(), torch.randn(8, 16)
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm.code)
        return gm.forward
    fast = _opt(model, (x,), ControlledClock({"cast_to_half": 0.5, "compile": 0.5}), backend,
                passes=["cast_to_half"], dtype=torch.bfloat16, device=Bf16Cpu())
    assert "cast_to_half" in fast.report.kept_passes and _compile_row(fast).kept
    assert seen and "bfloat16" in seen[0]  # the rewritten form, compiled first, is the bf16 graph
    # the original model compiled runs under autocast(bf16), the precision the pass sets
    original = _compile_row(fast, original=True)
    assert original.status in ("kept", "rejected") and original.max_abs_error is not None
    torch.testing.assert_close(fast(x).float(), model(x), rtol=1.6e-2, atol=1e-2)


def test_with_dtype_the_original_model_compiled_runs_under_autocast_when_faster():
    from rewriter.devices.executors import CompiledOriginal

    torch.manual_seed(0)
    model, x = ReluMLP().eval(), torch.randn(8, 16)
    fast = _opt(model, (x,), ControlledClock({"cast_to_half": 0.8, "compile": 0.7, "original": 0.5}),
                FakeCompiler(), passes=["cast_to_half"], dtype=torch.bfloat16, device=Bf16Cpu())
    assert _compile_row(fast, original=True).kept
    runner = fast._compiled["original"]
    assert isinstance(runner, CompiledOriginal) and runner.autocast == ("cpu", torch.bfloat16)
    out = fast(x)
    assert out.dtype == torch.bfloat16  # autocast's linear
    torch.testing.assert_close(out.float(), model(x), rtol=1.6e-2, atol=1e-2)


def test_a_short_run_gets_a_tenth_of_its_length_to_decide_in_and_no_report_profile():
    torch.manual_seed(0)
    model = ReluMLP().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    fast, _ = rewriter.optimize(model, (torch.randn(8, 16),), optimizer=opt, steps=10,
                                loss_fn=lambda out: out.pow(2).mean(), gate=QUICK, progress=False,
                                clock=ControlledClock({"fuse_optimizer": 0.3}), knowledge_base=False)
    assert any(n.startswith("time budget: 8 s, a tenth of the run") for n in fast.report.notes)
    assert "profile" not in fast.report.phases and any("profile: skipped" in n for n in fast.report.notes)
    # the optimizer, decided first, is reached however tight the budget
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_optimizer")
    assert d.kept and d.status == "kept"


def test_budget_arithmetic():
    assert deciding_budget(60.0, None, 0.5) == 60.0  # steps unknown: the time budget
    assert deciding_budget(60.0, 100, 0.5) == MIN_BUDGET  # a tenth of 100 steps of 0.5 s: 5 s
    assert deciding_budget(60.0, 300, 0.5) == 15.0  # a tenth of 300 steps of 0.5 s
    assert deciding_budget(60.0, 10, 0.5) == MIN_BUDGET
    assert deciding_budget(60.0, 10**6, 0.5) == 60.0 and deciding_budget(None, 10**6, 0.5) == 50_000


# --- the original model compiled, beside kept rewrites ----------------------------------------

@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_the_original_model_compiled_runs_when_it_beats_the_rewritten_one_compiled(mlp, front_end):
    """A rewrite can hide a pattern from the compiler: with rewrites kept, the original model
    compiled is a candidate too, and when it is the faster one it runs; the rewrites are
    superseded (not run) and the plan replays it."""
    from rewriter.devices.executors import CompiledOriginal

    model, x = mlp
    fake = FakeCompiler()
    clock = ControlledClock({"a": 0.8, "compile": 0.7, "original": 0.5})
    fast = _opt(model, (x,), clock, fake, passes=[RewriteRelu("a")], front_end=front_end)
    rewritten, original = _compile_row(fast), _compile_row(fast, original=True)
    assert original.kept and original.speedup == pytest.approx(0.8 / 0.35, rel=0.05)
    assert not rewritten.kept and "fake (original model) is faster still" in rewritten.reason
    a = next(d for d in fast.report.decisions if d.pass_name == "a")
    assert a.status == "superseded" and not a.kept and fast.report.kept_passes == ["compile"]
    assert isinstance(fast._compiled["original"], CompiledOriginal)
    assert fast.report.plan["kept_passes"] == [] and fast.report.plan["compile"]["kept"]
    before = fake.calls
    torch.testing.assert_close(fast(x), model(x))
    assert fake.calls > before  # the compiled original is what runs
    clock2, fake2 = ControlledClock(), FakeCompiler()
    again = _opt(model, (x,), clock2, fake2, passes=[RewriteRelu("a")], plan=fast.report.plan,
                 front_end=front_end)
    assert _compile_row(again).status == "replayed" and clock2.calls == 0
    assert isinstance(again._compiled["original"], CompiledOriginal) or "original" in again._compiled
    torch.testing.assert_close(again(x), model(x))


def test_the_original_model_compiled_is_not_kept_when_the_rewritten_one_is_faster(mlp):
    model, x = mlp
    fast = _opt(model, (x,), ControlledClock({"a": 0.5, "compile": 0.5, "original": 1.2}),
                FakeCompiler(), passes=[RewriteRelu("a")])
    assert _compile_row(fast).kept and not _compile_row(fast, original=True).kept
    assert fast.report.kept_passes == ["a", "compile"]


def test_nothing_kept_has_one_compile_candidate_the_original_model(mlp):
    model, x = mlp
    fast = _opt(model, (x,), ControlledClock({"compile": 0.5}), FakeCompiler(), passes=[])
    assert _compile_row(fast).kept
    assert not [d for d in fast.report.decisions if any("(original model" in s for s in d.sites)]


def test_a_regional_model_runs_the_original_compiled_with_its_blocks_lifted_for_good(monkeypatch):
    """Regional capture with a kept precision (bf16, run as autocast): the original model is
    compiled with the installed blocks lifted (its trace sees each block's own code), measured
    beside the rewritten step, and, kept, runs; the blocks then run their own forward when
    called directly, and restore() undoes everything. Its compile grows with depth, so it is
    weighed against ``steps`` (here predicted cheap)."""
    from rewriter.capture.install import FLAG
    from tests.test_regional import Block, Stack

    monkeypatch.setattr("rewriter.decide.compile_gate.predict_compile_seconds", lambda *a, **k: 1e-3)
    torch.manual_seed(0)
    model, x = Stack(n=3).eval(), torch.randn(8, 16)
    with torch.no_grad():
        want = model(x)
    fake = FakeCompiler()
    fast = _opt(model, (x,), ControlledClock({"cast_to_half": 0.8, "compile": 0.7, "original": 0.5}),
                fake, passes=["cast_to_half"], dtype=torch.bfloat16, device=Bf16Cpu(),
                regional=True, steps=100_000)
    assert fast.report.front_end == "regional", fast.report.front_end_reason
    original = _compile_row(fast, original=True)
    assert original.kept and "autocast bfloat16" in original.sites[0], original.reason
    assert not any(FLAG in b.__dict__ for b in model.blocks)  # lifted: traced as their own code
    bf16 = dict(rtol=1.6e-2, atol=1e-2)
    with torch.no_grad():
        before = fake.calls
        torch.testing.assert_close(fast(x).float(), want, **bf16)
        assert fake.calls > before
        torch.testing.assert_close(model(x), want)
    fast.restore()
    assert "forward" not in Block.__dict__ or Block.forward.__name__ == "forward"
    with torch.no_grad():
        torch.testing.assert_close(fast(x).float(), want, **bf16)


def test_a_regional_bf16_training_step_has_one_compile_candidate_the_original_model_under_autocast(monkeypatch):
    """Training beside a kept bf16 precision under a regional capture, one compile is paid: the
    original model under autocast, compiled whole (the form that won on every model measured);
    the regional compile of the bf16 graphs is a row that says why it is not tried. In
    inference (the bf16 graphs hold their weights cast once) both are offered."""
    from tests.test_regional import Stack

    torch.manual_seed(0)
    model, x = Stack(n=3).train(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = ControlledClock({"cast_to_half": 0.8, "compile": 0.7, "original": 0.5})
    fast, _ = _opt(model, (x,), clock, FakeCompiler(), optimizer=opt, loss_fn=lambda out: out.float().pow(2).mean(),
                   passes=["cast_to_half"], dtype=torch.bfloat16, device=Bf16Cpu(), regional=True)
    rows = [d for d in fast.report.decisions if d.pass_name == "compile"]
    tried = [d for d in rows if d.status != "not tried"]
    assert len(tried) == 1 and tried[0].kept and "(original model, autocast bfloat16)" in tried[0].sites[0]
    regional = next(d for d in rows if d.status == "not tried")
    assert "(regional, the bf16 graphs)" in regional.reason and "1.59x" in regional.reason
    assert fast.report.plan["compile"].get("form") == "original"
    assert [d.status for d in fast.report.decisions if d.pass_name == "cast_to_half"] == ["superseded"]
    fast.restore()

    monkeypatch.setattr("rewriter.decide.compile_gate.predict_compile_seconds", lambda *a, **k: 1e-3)  # repays
    inference = _opt(Stack(n=3).eval(), (x,), ControlledClock({"cast_to_half": 0.8, "compile": 0.7, "original": 0.5}),
                     FakeCompiler(), passes=["cast_to_half"], dtype=torch.bfloat16, device=Bf16Cpu(),
                     regional=True, steps=100_000)
    assert _compile_row(inference).status == "rejected" and _compile_row(inference, original=True).kept
    assert not any("(regional, the bf16 graphs)" in d.reason for d in inference.report.decisions)
    inference.restore()


def test_a_kept_regional_compile_runs_its_own_executors_graphs_after_another_was_tried():
    """The slots hold one executor's compiled forms at a time (NPU offers several): keeping
    the first one tried compiles its graphs again rather than run the last one's."""
    from rewriter.capture.blocks import find_blocks
    from rewriter.capture.regional import RegionalCapture
    from rewriter.devices.executors import RegionalCompiled

    model, x = _headed_stack()
    cap = RegionalCapture(model, "test", find_blocks(model))
    with torch.no_grad():
        want = cap(x)
        first, second = FakeCompiler(), FakeCompiler()
        runners = [RegionalCompiled(cap, first), RegionalCompiled(cap, second)]
        for runner in runners:
            runner(x)  # each compiled and run while tried
        runners[0].keep()
        before = (first.calls, second.calls)
        torch.testing.assert_close(cap(x), want)
        assert first.calls > before[0] and second.calls == before[1]
    cap.remove()


def test_a_regional_model_with_nothing_rewritten_compiles_each_graph_once():
    """Nothing rewritten kept: the compiled form of a regional capture is still regional (each
    block's own graph compiled once for every instance, each graph around the blocks once), so
    the compile does not grow with depth; it runs through the installed blocks after optimize()."""
    from tests.test_regional import Stack

    class Head(nn.Module):  # a module of the model's own: its frame is captured (torch.nn's is not)
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return torch.tanh(self.fc(x)) + 1.0

    torch.manual_seed(0)
    model, x = Stack(n=4).eval(), torch.randn(8, 16)
    model.head = Head()
    with torch.no_grad():
        want = model(x)
    fake = FakeCompiler()
    fast = _opt(model, (x,), ControlledClock({"compile": 0.5}), fake, passes=[], regional=True)
    row = _compile_row(fast)
    assert row.kept and fast.report.kept_passes == ["compile"] and "dynamo" in fast._compiled
    assert not [d for d in fast.report.decisions if any("(original model" in s for s in d.sites)]
    slots = fast._outcome.capture.slots
    block_graphs = [s for s in slots if s.block is not None]
    around = [s for s in slots if s.block is None]  # the head
    assert block_graphs and around and fake.compiles == len(slots)  # once each, not once per layer
    assert all(s.compiled_form is not None for s in slots)
    with torch.no_grad():
        before = fake.calls
        torch.testing.assert_close(fast(x), want)
        assert fake.calls - before == 4 + len(around)  # every layer ran the one compiled block graph
    fast.restore()


class _Head(nn.Module):
    """A head of the model's own (its frame is captured around the blocks; torch.nn's is not)."""

    def __init__(self, act=torch.tanh):
        super().__init__()
        self.fc, self.act = nn.Linear(16, 4), act

    def forward(self, x):
        return self.act(self.fc(x)) + 1.0


def _headed_stack(n=3):
    from tests.test_regional import Stack

    torch.manual_seed(0)
    model = Stack(n=n).eval()
    model.head = _Head()
    return model, torch.randn(8, 16)


class GraphRecordingCompiler(FakeCompiler):
    """A FakeCompiler that keeps the graphs it was handed."""

    def __init__(self):
        super().__init__()
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return super().__call__(gm, example_inputs)


@pytest.mark.parametrize("regional_factor", [1.0, 0.5])
def test_nothing_rewritten_kept_the_regional_compile_is_the_one_candidate(monkeypatch, regional_factor):
    """Nothing rewritten kept: the regional compile (every graph, a block's once) and the whole
    model's are the same code; the whole model's, unrolled and growing with depth, is not
    paid, whatever the regional one measured (a row says why)."""
    monkeypatch.setattr("rewriter.decide.compile_gate.predict_compile_seconds", lambda *a, **k: 1e-3)
    model, x = _headed_stack()
    fast = _opt(model, (x,), ControlledClock({"compile": regional_factor, "original": 0.5}),
                FakeCompiler(), passes=[], regional=True, steps=100_000)
    rows = [d for d in fast.report.decisions if d.pass_name == "compile"]
    tried, = [d for d in rows if d.sites == ["fake"]]
    whole, = [d for d in rows if d is not tried]
    assert whole.status == "not tried" and "the regional compile (fake) is the candidate" in whole.reason
    assert tried.kept == (regional_factor < 1)
    fast.restore()


def _compiler_makes_a_itself(monkeypatch):
    monkeypatch.setattr("rewriter.decide.compile_gate.FUSING_EXECUTORS", ("fake",))
    monkeypatch.setitem(compile_gate.COMPILER_DOES_ITSELF, "a", "a test rewrite the compiler makes")
    monkeypatch.setattr("rewriter.decide.compile_gate.predict_compile_seconds", lambda *a, **k: 1e-3)


def test_rewrites_the_compiler_makes_itself_are_set_aside_for_one_compile_of_the_original_graphs(monkeypatch):
    """Regional capture, every kept rewrite one the compiler makes itself: the one candidate
    is the original graphs compiled regionally (each once), measured against the rewritten
    eager step; kept, the rewrite is superseded, the compiled original graphs run, and a plan
    replays it. The whole original model's compile is not offered."""
    _compiler_makes_a_itself(monkeypatch)
    model, x = _headed_stack()
    with torch.no_grad():
        want = model(x)
    fake = GraphRecordingCompiler()
    fast = _opt(model, (x,), ControlledClock({"a": 0.8, "compile": 0.7, "original": 0.5}), fake,
                passes=[RewriteRelu("a")], regional=True, steps=100_000)
    rows = [d for d in fast.report.decisions if d.pass_name == "compile"]
    tried, = [d for d in rows if d.status != "not tried"]
    whole, = [d for d in rows if d.status == "not tried"]
    assert tried.kept and tried.sites == ["fake (original graphs)"] and "(original model" in whole.reason
    a = next(d for d in fast.report.decisions if d.pass_name == "a")
    assert a.status == "superseded" and "compiled without them (fake (original graphs))" in a.reason
    assert fast.report.kept_passes == ["compile"] and fast.report.plan["kept_passes"] == []
    assert fast.report.plan["compile"]["set_aside"] == ["a"]
    slots = fast._outcome.capture.slots
    assert len(fake.graphs) == len(slots) == 2  # the block's graph once, the head's
    assert sorted(map(_relus, fake.graphs)) == sorted(_relus(s.original) for s in slots) == [0, 1]
    with torch.no_grad():
        before = fake.calls
        torch.testing.assert_close(fast(x), want)
        assert fake.calls - before == 3 + 1  # three layers through the one block graph, the head
    clock2 = ControlledClock()
    again = _opt(model, (x,), clock2, FakeCompiler(), passes=[RewriteRelu("a")], regional=True,
                 steps=100_000, plan=fast.report.plan)
    assert [d.status for d in again.report.decisions if d.pass_name == "compile"] == ["replayed"]
    with torch.no_grad():
        torch.testing.assert_close(again(x), want)
    fast.restore()
    again.restore()


def test_a_whole_model_trace_is_predicted_to_cost_less_for_the_block_instances_it_repeats():
    """The whole model's compile (not offered beside the regional one; its row gives its
    predicted cost) unrolls the three blocks: the second and third instances' nodes are
    predicted at REPEATED_NODE_FACTOR of a node's seconds, their kernels being the first's."""
    from rewriter.decide.compile_size import calls_in
    model, x = _headed_stack()
    fast = _opt(model, (x,), ControlledClock(), FakeCompiler(), passes=[], regional=True, steps=100_000)
    whole, = [d for d in fast.report.decisions if d.status == "not tried" and "(original model)" in d.reason
              and "regional compile" in d.reason]
    slots = fast._outcome.capture.slots
    block, = [s for s in slots if s.calls > 1]
    unrolled = sum(max(s.calls, 1) * calls_in(s.original) for s in slots)
    repeated = (block.calls - 1) * calls_in(block.original)
    assert block.calls == 3 and 0 < repeated < unrolled
    predicted = predict_compile_seconds(unrolled, False, repeated=repeated)
    assert whole.measurement["predicted_compile_seconds"] == pytest.approx(predicted, abs=1e-3)
    assert predict_compile_seconds(unrolled - repeated, False) < predicted < predict_compile_seconds(unrolled, False)
    fast.restore()


def _relus(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.relu, torch.relu))


def test_only_the_rewrites_the_compiler_makes_itself_are_set_aside(monkeypatch):
    """Two rewrites kept, one the compiler makes itself ("a"), one it does not ("b"): the one
    candidate compiles graphs built with "b" only; kept, "a" is superseded and "b" stays."""
    _compiler_makes_a_itself(monkeypatch)
    model, x = _headed_stack()
    with torch.no_grad():
        want = model(x)
    fake = GraphRecordingCompiler()
    fast = _opt(model, (x,), ControlledClock({"a": 0.8, "b": 0.9, "compile": 0.7, "original": 0.5}),
                fake, passes=[RewriteRelu("a"), RewriteRelu("b")], regional=True, steps=100_000)
    tried, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert tried.kept and tried.sites == ["fake (without a)"]
    status = {d.pass_name: d.status for d in fast.report.decisions if d.pass_name in ("a", "b")}
    assert status == {"a": "superseded", "b": "kept"}
    assert fast.report.kept_passes == ["b", "compile"] and fast.report.plan["kept_passes"] == ["b"]
    block = next(g for g in fake.graphs if _relus(g))
    assert _relus(block) == 2  # the block's relu and b's, not a's on top
    with torch.no_grad():
        torch.testing.assert_close(fast(x), want)
    fast.restore()


def test_a_graph_outside_the_blocks_that_runs_a_set_aside_rewrite_stays_eager_with_it(monkeypatch):
    """"a" is kept in the blocks and in the head: the block graph is compiled without it, the
    head's graph is not compiled and runs "a" as measured (a causal LM's fused loss), so "a"
    is not superseded."""
    _compiler_makes_a_itself(monkeypatch)
    model, x = _headed_stack()
    model.head = _Head(torch.relu)
    with torch.no_grad():
        want = model(x)
    fake = GraphRecordingCompiler()
    fast = _opt(model, (x,), ControlledClock({"a": 0.8, "compile": 0.7, "original": 0.5}), fake,
                passes=[RewriteRelu("a")], regional=True, steps=100_000)
    tried, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert tried.kept and tried.sites == ["fake"]  # nothing it sets aside stops running
    assert {d.pass_name: d.status for d in fast.report.decisions if d.pass_name == "a"} == {"a": "kept"}
    assert fast.report.kept_passes == ["a", "compile"]
    # one graph compiled: the block's, with its own relu only; the head's never went
    assert len(fake.graphs) == 1 and _relus(fake.graphs[0]) == 1
    with torch.no_grad():
        torch.testing.assert_close(fast(x), want)
    head = next(s for s in fast.__dict__["_outcome"].capture.slots if s.block is None)
    assert head.compiler is None and _relus(head.kept_run) == 2  # eager, a's relu in
    fast.restore()


def test_the_original_graphs_compiled_and_slower_leave_the_rewrite_kept(monkeypatch):
    _compiler_makes_a_itself(monkeypatch)
    model, x = _headed_stack()
    with torch.no_grad():
        want = model(x)
    fast = _opt(model, (x,), ControlledClock({"a": 0.8, "compile": 1.2, "original": 1.0}),
                FakeCompiler(), passes=[RewriteRelu("a")], regional=True, steps=100_000)
    tried, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert not tried.kept and tried.sites == ["fake (original graphs)"]
    assert fast.report.kept_passes == ["a"] and not fast._compiled
    with torch.no_grad():
        torch.testing.assert_close(fast(x), want)
    fast.restore()


def test_the_knowledge_base_tells_a_compile_with_rewrites_set_aside_from_one_without(monkeypatch, tmp_path):
    """Same model, same kept rewrite: the compile of graphs without it and the compile of the
    rewritten graphs are different compiles, remembered apart; each is reused as itself."""
    _compiler_makes_a_itself(monkeypatch)
    kb = tmp_path / "kb.json"
    model, x = _headed_stack()

    def run(costs):
        clock = ControlledClock(costs)
        fast = _opt(model, (x,), clock, FakeCompiler(), passes=[RewriteRelu("a")], regional=True,
                    steps=100_000, knowledge_base=kb)
        row, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
        fast.restore()
        return row, clock

    first, _ = run({"a": 0.8, "compile": 0.7, "original": 0.5})
    assert first.kept and first.sites == ["fake (original graphs)"]
    again, clock = run({"a": 0.8, "compile": 3.0, "original": 3.0})  # slower, were it measured
    assert again.kept and "knowledge base" in again.reason and _compiled_samples(clock) == 0
    monkeypatch.delitem(compile_gate.COMPILER_DOES_ITSELF, "a")  # now the rewritten graphs
    other, clock = run({"a": 0.8, "compile": 3.0, "original": 3.0})
    assert other.sites == ["fake"] and not other.kept and "knowledge base" not in other.reason
    assert _compiled_samples(clock) > 0  # measured: not the set-aside compile's entry


class _LossHead(nn.Module):
    """A head with its loss: logits soft-capped (Gemma 2's ``c * tanh(z / c)``) or not."""

    def __init__(self, cap=None):
        super().__init__()
        self.fc, self.cap = nn.Linear(16, 4), cap

    def forward(self, x):
        logits = self.fc(torch.relu(x))
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return F.cross_entropy(logits.float().view(-1, 4), torch.arange(x.shape[0]) % 4)


@pytest.mark.parametrize("original, heads_win", [(0.5, True), (1.0, False)])
def test_a_loss_graph_with_soft_capped_logits_is_compiled_too_as_a_second_candidate(monkeypatch, original, heads_win):
    """"a" (set aside) runs in a head whose loss reads soft-capped logits: beside the regional
    compile with that head eager (running "a"), one more candidate compiles the head too (without
    "a"); the faster verified one runs, the other's row says so."""
    _compiler_makes_a_itself(monkeypatch)
    model, x = _headed_stack()
    model.head = _LossHead(cap=3.0)
    with torch.no_grad():
        want = model(x)
    fast = _opt(model, (x,), ControlledClock({"a": 0.8, "compile": 0.7, "original": original}),
                GraphRecordingCompiler(), passes=[RewriteRelu("a")], regional=True, steps=100_000)
    eager_head, compiled_head = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert eager_head.sites == ["fake"] and compiled_head.sites == ["fake (original graphs; the loss graph compiled)"]
    winner, loser = (compiled_head, eager_head) if heads_win else (eager_head, compiled_head)
    assert winner.kept and not loser.kept and "is faster still" in loser.reason
    a = next(d for d in fast.report.decisions if d.pass_name == "a")
    assert a.status == ("superseded" if heads_win else "kept")
    head = next(s for s in fast.__dict__["_outcome"].capture.slots if s.block is None)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), want)
        assert (head.compiler is None) == (not heads_win)  # the head's graph compiled, or eager
    fast.restore()


def test_a_loss_graph_without_arithmetic_on_its_logits_is_not_offered_compiled(monkeypatch):
    _compiler_makes_a_itself(monkeypatch)
    model, x = _headed_stack()
    model.head = _LossHead(cap=None)
    fast = _opt(model, (x,), ControlledClock({"a": 0.8, "compile": 0.7, "original": 0.5}),
                GraphRecordingCompiler(), passes=[RewriteRelu("a")], regional=True, steps=100_000)
    tried, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert tried.sites == ["fake"]  # the head eager with "a": no second form
    fast.restore()


@pytest.mark.parametrize("head, arithmetic", [
    (lambda z: z, False),                                         # the GEMM's output as it is
    (lambda z: z.float().contiguous()[:, :4], False),             # casts, views and slices only
    (lambda z: torch.tanh(z / 30.0) * 30.0, True),                # Gemma 2's soft-cap
    (lambda z: (z * 0.5).float(), True),                          # a scale left in place
    (lambda z: torch.log_softmax(z, -1), False),                  # not pointwise arithmetic
])
def test_logits_arithmetic_is_pointwise_work_between_the_head_and_its_loss(head, arithmetic):
    from rewriter.decide.set_aside import logits_arithmetic

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, y):
            return F.cross_entropy(head(self.fc(x)), y)
    assert logits_arithmetic(torch.fx.symbolic_trace(M())) == arithmetic
