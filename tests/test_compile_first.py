"""The compile decided first (rewriter.decide.compile_first): in bf16 training under a regional
capture, where the compile is predicted to repay within the run, the original model under
autocast is compiled, verified and timed against the eager step under the same autocast before
any pass is measured; kept (and not slower than the original step), the passes are not measured
at all. Not kept, the passes are decided as before and the same compile is not paid again. A
plan replays the compiled form under the autocast it was measured in. Controlled clocks: a
step's time is set by the passes it contains (tests.controlled)."""
from __future__ import annotations

import pytest
import torch

import rewriter
from rewriter.devices.executors import CompiledOriginal
from tests.controlled import QUICK, Bf16Cpu, ControlledClock, RewriteRelu
from tests.test_compile_gate import FakeCompiler
from tests.test_regional import Stack


@pytest.fixture(autouse=True)
def _compile_predicted_cheap(monkeypatch):
    """Every compile here is predicted to repay within the run (the real prediction is a fit
    for transformer blocks, tens of seconds)."""
    monkeypatch.setattr("rewriter.decide.compile_gate.predict_compile_seconds", lambda *a, **k: 1e-3)


def _train(clock, compiler, **kw):
    torch.manual_seed(0)
    model, x = Stack(n=3).train(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("steps", 100_000)
    kw.setdefault("dtype", torch.bfloat16)
    fast, _ = rewriter.optimize(
        model, (x,), optimizer=opt, loss_fn=lambda out: out.float().pow(2).mean(), clock=clock, gate=QUICK,
        profile=False, progress=False, knowledge_base=False, compile=compiler, device=Bf16Cpu(), regional=True,
        passes=["cast_to_half", RewriteRelu("a")], **kw)
    return fast, x


def _rows(fast, name):
    return [d for d in fast.report.decisions if d.pass_name == name]


def test_a_compile_that_would_supersede_every_rewrite_is_decided_first_and_the_passes_are_not_measured():
    clock = ControlledClock({"cast_to_half": 0.8, "a": 0.9, "compile": 0.7, "original": 0.5})
    fast, x = _train(clock, FakeCompiler())
    try:
        (compiled,) = _rows(fast, "compile")
        assert compiled.kept and compiled.reason.startswith("decided first, against the eager step under autocast")
        assert "(original model, autocast bfloat16)" in compiled.sites[0]
        for name in ("cast_to_half", "a"):
            (row,) = _rows(fast, name)
            assert row.status == "not tried" and "decided first and kept" in row.reason, row.reason
        timed = {p for passes in clock.seen for p in passes}
        assert "a" not in timed  # no step or region with the graph rewrite was ever timed
        # timed against the eager step under autocast (its precision), then against the original
        assert ("cast_to_half",) in clock.seen and () in clock.seen
        assert fast.report.final["kept"] and "decided before the eager rewrites" in fast.report.final["reason"]
        assert fast.report.plan["kept_passes"] == []
        assert fast.report.plan["compile"] == {"executor": "fake", "kept": True, "form": "original",
                                               "nested": False, "autocast": "bfloat16"}
        with torch.no_grad():
            assert fast(x).dtype == torch.bfloat16  # the compiled original runs under autocast
    finally:
        fast.restore()


def test_a_compile_decided_first_and_slower_leaves_the_passes_decided_as_before_and_is_not_paid_again():
    compiler = FakeCompiler()
    clock = ControlledClock({"cast_to_half": 0.8, "a": 0.9, "compile": 1.6, "original": 1.0})
    fast, _ = _train(clock, compiler)
    try:
        # one compile tried: not again after the passes (the other row: the regional form not offered)
        (compiled,) = [d for d in _rows(fast, "compile") if d.status != "not tried"]
        assert not compiled.kept and compiled.reason.startswith("decided first"), compiled.reason
        assert _rows(fast, "a")[0].status == "kept" and _rows(fast, "cast_to_half")[0].status == "kept"
        assert fast.report.final["kept"] and "decided before" not in fast.report.final["reason"]
        assert fast.report.plan["compile"] is None or not fast.report.plan["compile"].get("kept")
        assert fast.__dict__["_compiled"] is None
    finally:
        fast.restore()


def test_the_step_check_against_the_original_rejects_a_compile_faster_only_than_the_eager_autocast_step():
    """The eager step under autocast far slower than the original (a CPU without fast bf16), the
    compiled one between them: faster than its baseline, slower than what the user runs."""
    clock = ControlledClock({"cast_to_half": 3.0, "a": 0.9, "compile": 1.5, "original": 1.0})
    fast, _ = _train(clock, FakeCompiler())
    try:
        # the precision rejected, the compile gate then tries the fp32 regional form, another one
        (compiled,) = [d for d in _rows(fast, "compile") if any("(original model" in s for s in d.sites)]
        assert not compiled.kept and compiled.reason.startswith("slower than the original step"), compiled.reason
        assert _rows(fast, "cast_to_half")[0].status == "rejected"  # decided as before
        assert _rows(fast, "a")[0].status == "kept"
    finally:
        fast.restore()


@pytest.mark.parametrize("kw", [dict(steps=None), dict(objective="memory"), dict(dtype=None)],
                         ids=["no-steps", "memory-objective", "fp32"])
def test_without_a_run_length_a_bf16_precision_or_the_time_objective_the_passes_come_first(kw):
    clock = ControlledClock({"cast_to_half": 0.8, "a": 0.9, "compile": 0.7, "original": 0.5})
    fast, _ = _train(clock, FakeCompiler(), **kw)
    try:
        assert not any(d.reason.startswith("decided first") for d in _rows(fast, "compile"))
        assert _rows(fast, "a")[0].status != "not tried"
        assert any("a" in passes for passes in clock.seen)
    finally:
        fast.restore()


@pytest.mark.parametrize("first", [True, False], ids=["decided-first", "after-the-passes"])
def test_a_plan_replays_the_compiled_original_under_the_autocast_it_was_measured_in(first):
    """The precision pass is superseded, so out of the plan's kept passes: the plan's compile
    entry carries the autocast (a replay compiled the fp32 model before)."""
    clock = ControlledClock({"cast_to_half": 0.8, "a": 0.9, "compile": 0.7, "original": 0.5})
    fast, x = _train(clock, FakeCompiler(), **({} if first else dict(steps=None)))
    plan = fast.report.plan
    fast.restore()
    assert plan["compile"]["autocast"] == "bfloat16" and "cast_to_half" not in plan["kept_passes"]
    torch.manual_seed(0)
    again = rewriter.optimize(Stack(n=3).train(), (x,), plan=plan, compile=FakeCompiler(), dtype=torch.bfloat16,
                              device=Bf16Cpu(), regional=True, profile=False, progress=False, knowledge_base=False)
    try:
        assert [d.status for d in _rows(again, "compile")] == ["replayed"]
        runner = again.__dict__["_compiled"]["original"]
        assert isinstance(runner, CompiledOriginal) and runner.autocast == ("cpu", torch.bfloat16)
        with torch.no_grad():
            assert again(x).dtype == torch.bfloat16
    finally:
        again.restore()


class SlowCompiler(FakeCompiler):
    """A compile that takes ``seconds`` of wall time (the deciding budget is wall time)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def __call__(self, gm, example_inputs):
        import time
        time.sleep(self.seconds)
        return super().__call__(gm, example_inputs)


def test_a_compile_decided_first_and_not_kept_leaves_the_passes_the_deciding_budget_they_had():
    """The compile after the passes never took their budget; decided first and not kept, the
    seconds it took are added back (a 1 s budget, a compile of 1.2 s)."""
    clock = ControlledClock({"cast_to_half": 0.8, "a": 0.9, "compile": 1.6, "original": 1.0})
    fast, _ = _train(clock, SlowCompiler(1.2), time_budget=1.0)
    try:
        (compiled,) = [d for d in _rows(fast, "compile") if d.status != "not tried"]
        assert not compiled.kept and compiled.reason.startswith("decided first"), compiled.reason
        assert _rows(fast, "a")[0].status == "kept", _rows(fast, "a")[0].reason
    finally:
        fast.restore()
