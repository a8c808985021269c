"""A compile's time limit (rewriter.devices.compile_limit): a compile that runs past what the run
could repay is stopped, reported "abandoned", remembered, and the eager graphs run.

The compiler is a fake torch.compile backend that never finishes by itself (a Python loop, as
Inductor's sympy simplification of Funnel's backward was); the limit is set to a fraction of a
second through the gate's ``compile_time_limit``, so no test waits on the real rule's minutes.
"""
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import rewriter
from rewriter.decide import compile_gate
from rewriter.decide.amortize import MAX_SAVING, OVERRUN_FACTOR, REPAY_FRACTION, compile_time_limit
from rewriter.devices.compile_limit import CompileLimit, CompileOverran
from tests.controlled import QUICK, ControlledClock, RewriteRelu
from tests.models import ReluMLP

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no setitimer on this platform")


def _spin(seconds: float) -> float:
    """Pure-Python work until ``seconds`` have passed (the limit must stop it first)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sum(range(1000))
    return time.perf_counter() - t0


def test_the_limit_stops_what_runs_inside_it_and_puts_the_handler_back():
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.perf_counter()
    with pytest.raises(CompileOverran, match="still compiling after"):
        with CompileLimit(0.2) as limit:
            assert limit.armed
            _spin(30.0)
    assert limit.overran and time.perf_counter() - t0 < 10.0
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_a_compile_that_ends_in_time_is_not_stopped_and_the_timer_is_cleared():
    with CompileLimit(30.0) as limit:
        _spin(0.05)
    assert not limit.overran and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_no_limit_sets_nothing():
    with CompileLimit(None) as limit:
        assert not limit.armed
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0 and limit._timer is None


def test_under_the_callers_own_timer_a_thread_stops_the_compile_and_the_callers_alarm_is_left_alone():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(a))
    signal.setitimer(signal.ITIMER_REAL, 60.0)  # the caller's own timer (pytest-timeout's kind)
    try:
        t0 = time.perf_counter()
        with pytest.raises(CompileOverran, match="still compiling after"):
            with CompileLimit(0.2) as limit:
                assert limit.armed == "thread"
                _spin(30.0)
        assert limit.overran and time.perf_counter() - t0 < 10.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 50.0 and not fired  # left running
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_the_limit_stops_that_thread_and_nothing_is_raised_later():
    seen = {}

    def compile_in_a_worker():
        try:
            with CompileLimit(0.2) as limit:
                seen["armed"] = limit.armed
                _spin(30.0)
        except CompileOverran as e:
            seen["stopped"] = (limit.overran, str(e))
        _spin(0.3)  # past the limit and out of it: nothing pending raises here
        seen["after"] = True
        with CompileLimit(0.2) as limit:  # a compile that ends in time: its timer cancelled
            _spin(0.01)
        _spin(0.4)
        seen["in_time"] = not limit.overran

    t = threading.Thread(target=compile_in_a_worker)
    t.start()
    t.join(30.0)
    assert seen["armed"] == "thread" and seen["stopped"][0] and "still compiling after" in seen["stopped"][1]
    assert seen["after"] and seen["in_time"]


_FIRE_THEN_PROFILE = """
import signal, time, torch
from rewriter.devices.compile_limit import CompileLimit, CompileOverran
signal.signal(signal.SIGALRM, lambda *a: None)
signal.setitimer(signal.ITIMER_REAL, 60.0)  # the caller's timer: the thread form
try:
    with CompileLimit(0.1) as limit:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 10:
            pass
except CompileOverran:
    pass
signal.setitimer(signal.ITIMER_REAL, 0)
with torch.profiler.profile(with_stack=True):
    torch.ones(3).sum()
print("profiled", limit.armed == "", limit.overran)
"""


def test_after_the_thread_form_fired_the_interpreter_runs_on_as_before():
    # Withdrawing a pending asynchronous exception through the C API left CPython's eval
    # breaker set: the next torch.profiler(with_stack=True) spun at 100 % CPU (own process,
    # as a hang cannot be stopped from Python)
    done = subprocess.run([sys.executable, "-c", _FIRE_THEN_PROFILE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "profiled True True" in done.stdout, done.stderr[-2000:]


def test_the_limit_is_what_the_best_saving_repays_in_the_runs_first_tenth_or_thrice_the_prediction():
    assert compile_time_limit(None, 0.25, 40.0) is None
    assert compile_time_limit(20_000, 0.25, 40.0) == pytest.approx(REPAY_FRACTION * 20_000 * MAX_SAVING * 0.25)
    assert compile_time_limit(1_000, 0.25, 40.0) == pytest.approx(OVERRUN_FACTOR * 40.0)


class EndlessCompiler:
    """A torch.compile backend whose compile would run for minutes (a Python loop)."""

    __name__ = "endless"

    def __init__(self):
        self.started = self.finished = 0

    def __call__(self, gm, example_inputs):
        self.started += 1
        _spin(120.0)
        self.finished += 1
        return gm


def _warm_dynamo():
    """Dynamo imported and set up, so a model's trace takes well under the tests' limit (the
    limit stops whatever runs, tracing included: the assertions hold either way)."""
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))


def _opt(model, x, compiler, kb, steps=20_000, passes=(), **kw):
    return rewriter.optimize(model, (x,), clock=ControlledClock({"compile": 0.5, "a": 0.5}), profile=False,
                             progress=False, compile=compiler, gate=QUICK, knowledge_base=kb,
                             steps=steps, passes=list(passes), **kw)


def test_a_compile_past_its_limit_is_abandoned_remembered_and_the_eager_graphs_run(monkeypatch, tmp_path):
    limit = {"s": 3.0}  # Dynamo traces the model within it, then the compiler spins
    monkeypatch.setattr(compile_gate, "compile_time_limit", lambda steps, step_s, predicted: limit["s"])
    torch.manual_seed(0)
    model, x = ReluMLP().train(), torch.randn(8, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    kb, compiler = tmp_path / "kb.json", EndlessCompiler()
    _warm_dynamo()
    t0 = time.perf_counter()
    fast, opt2 = _opt(model, x, compiler, kb, optimizer=opt, loss_fn=lambda out: out.square().mean())
    assert time.perf_counter() - t0 < 60.0 and compiler.finished == 0
    started = compiler.started  # 1: stopped while compiling (0 only where tracing took the 3 s)
    [d] = [d for d in fast.report.decisions if d.pass_name == "compile"]
    assert d.status == "abandoned" and not d.kept and "eager graphs run" in d.reason
    assert d.measurement["limit_seconds"] == 3.0 and d.measurement["compile_abandoned"] >= 3.0
    assert fast.report.plan["compile"]["kept"] is False and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    for k, v in model.state_dict().items():  # measuring and the stopped compile left them alone
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    fast(x).square().mean().backward()  # the eager graphs train
    opt2.step()
    assert compiler.started == started
    # the next run of the same length does not pay it again, whatever it keeps (the compile's
    # own key has the kept rewrites); a limit twice as long tries afresh
    def training(passes=()):
        return _opt(model, x, compiler, kb, passes=passes, loss_fn=lambda out: out.square().mean(),
                    optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))[0]

    again = training(passes=[RewriteRelu("a")])
    rows = [d for d in again.report.decisions if d.pass_name == "compile"]
    assert "a" in again.report.kept_passes and compiler.started == started
    assert rows and all(d.status == "not tried" and "earlier run abandoned" in d.reason for d in rows)
    limit["s"] = 3.3  # a step measured a little slower lengthens the limit: not enough to retry
    rows = [d for d in training().report.decisions if d.pass_name == "compile"]
    assert [d.status for d in rows] == ["not tried"] and "is not twice that" in rows[0].reason
    limit["s"] = 600.0
    monkeypatch.setattr(EndlessCompiler, "__call__", lambda self, gm, inputs: gm)
    [d] = [d for d in training().report.decisions if d.pass_name == "compile"]
    assert d.status in ("kept", "rejected") and d.measurement.get("speedup") is not None


def test_without_steps_an_abandoned_compile_is_not_tried_and_the_row_says_what_would_try_it(monkeypatch, tmp_path):
    """compile=<backend> without steps has no limit: a compile an earlier run abandoned is not
    started unbounded; the row names steps= as what lets it be tried."""
    monkeypatch.setattr(compile_gate, "compile_time_limit", lambda steps, step_s, predicted: 3.0 if steps else None)
    torch.manual_seed(0)
    model, x = ReluMLP().eval(), torch.randn(8, 16)
    kb, compiler = tmp_path / "kb.json", EndlessCompiler()
    _warm_dynamo()
    first = _opt(model, x, compiler, kb)
    assert [d.status for d in first.report.decisions if d.pass_name == "compile"] == ["abandoned"]
    started = compiler.started
    again = _opt(model, x, compiler, kb, steps=None)
    [d] = [d for d in again.report.decisions if d.pass_name == "compile"]
    assert d.status == "not tried" and "without steps=" in d.reason and compiler.started == started
    torch.testing.assert_close(again(x), model(x))
