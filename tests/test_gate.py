"""The gate's decisions, with controlled times (no wall-clock thresholds)."""
import dataclasses
import math
import random
import types

import pytest
import torch

import rewriter
from rewriter.decide import gate
from rewriter.decide.gate import (
    GateSettings,
    Measurement,
    Step,
    clearly_one_way,
    conclusive_or_on_the_line,
    decide,
    measure,
)
from tests.controlled import QUICK, ControlledClock, RewriteRelu, StepRelu
from tests.models import ReluMLP


def _opt(model, x, passes, costs, **kw):
    return rewriter.optimize(model, (x,), passes=passes, clock=ControlledClock(costs),
                             gate=QUICK, profile=False, progress=False, **kw)


def _decision(fast, name):
    return next(d for d in fast.report.decisions if d.pass_name == name)


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return ReluMLP().eval(), torch.randn(4, 16)


def test_certainly_faster_pass_is_kept(mlp):
    model, x = mlp
    fast = _opt(model, x, [RewriteRelu("fast")], {"fast": 0.5})
    d = _decision(fast, "fast")
    assert d.kept and d.status == "kept" and d.speedup == pytest.approx(2.0, rel=0.05)
    assert fast.report.final["kept"] and fast.report.kept_passes == ["fast"]
    made = [n for slot in fast._outcome.capture.slots for n in slot.kept.graph.nodes
            if n.meta.get("rewriter_pass") == "fast"]
    assert made, "the kept graph holds the nodes the pass made"


def test_certainly_slower_pass_is_rejected(mlp):
    model, x = mlp
    fast = _opt(model, x, [RewriteRelu("slow")], {"slow": 2.0})
    d = _decision(fast, "slow")
    assert not d.kept and d.status == "rejected" and "slower" in d.reason
    assert d.speedup == pytest.approx(0.5, rel=0.05)
    assert fast.report.kept_passes == [] and not fast.report.final["kept"]


def test_gain_below_min_speedup_is_rejected(mlp):
    model, x = mlp
    fast = _opt(model, x, [RewriteRelu("meh")], {"meh": 1 / 1.02}, min_speedup=1.05)
    d = _decision(fast, "meh")
    assert not d.kept and "below min_speedup" in d.reason


def test_pass_that_changes_numerics_is_rejected_even_if_faster(mlp):
    model, x = mlp
    fast = _opt(model, x, [RewriteRelu("wrong", shift=1e-2)], {"wrong": 0.1})
    d = _decision(fast, "wrong")
    assert not d.kept and d.status == "failed verification" and d.speedup is None
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


@pytest.mark.parametrize("where", ["find", "apply"])
def test_pass_that_raises_is_reverted_and_the_rest_go_on(mlp, where):
    model, x = mlp
    fast = _opt(model, x, [RewriteRelu("bad", raise_in=where), RewriteRelu("good")],
                {"bad": 0.5, "good": 0.5})
    bad, good = _decision(fast, "bad"), _decision(fast, "good")
    assert bad.status == "raised"
    assert ("cannot handle" if where == "find" else "gave up") in bad.reason
    assert good.kept
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_pass_that_returns_a_broken_graph_is_reverted(mlp):
    model, x = mlp
    fast = _opt(model, x, [RewriteRelu("broken", broken=True)], {"broken": 0.5})
    d = _decision(fast, "broken")
    assert d.status == "failed verification" and "raised" in d.reason
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_greedy_order_measures_against_kept_state(mlp):
    model, x = mlp
    clock = ControlledClock({"a": 0.5, "b": 0.9})
    rewriter.optimize(model, (x,), passes=[RewriteRelu("a"), RewriteRelu("b")], clock=clock,
                      gate=QUICK, profile=False, progress=False)
    assert ("a", "b") in clock.seen  # b's candidate ran on top of kept a
    assert ("a",) in clock.seen


def test_composed_step_that_is_measurably_slower_returns_the_original(mlp):
    """The region looked faster, but the composed step is slower than the original
    (interaction): ablation reverts the only kept decision, and the original model runs."""
    model, x = mlp
    clock = ControlledClock({"a": 0.5}, step_costs={"a": 1.3})
    fast = rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=clock, gate=QUICK,
                             profile=False, progress=False)
    d = _decision(fast, "a")
    assert not d.kept and d.status == "reverted" and "ablation" in d.reason
    assert not fast.report.final["kept"] and fast.report.kept_passes == []
    assert fast._runner() is model


def test_measurement_statistics():
    m = Measurement([1.0, 1.1, 0.9, 1.0, 1.0], [0.5, 0.55, 0.45, 0.5, 0.5])
    assert m.speedup == pytest.approx(2.0)
    assert m.noise == pytest.approx(0.0)
    noisy = Measurement([1.0, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert noisy.noise > 0.3


def test_decide_wants_the_gain_to_clear_the_noise():
    m = Measurement([1.2, 0.9, 1.3, 0.8, 1.25, 0.85], [1.0] * 6)
    keep, reason = decide(m, min_speedup=1.01)
    assert not keep and ("noise" in reason or "slower" in reason)
    assert not decide(Measurement(), 1.0)[0]


def test_measure_interleaves_and_alternates_order():
    order = []
    a = Step(lambda: order.append("A"), (), "a")
    b = Step(lambda: order.append("B"), ("x",), "b")
    clock = ControlledClock({"x": 0.5}, jitter=0.0)
    m = measure(a, b, clock=clock, settings=GateSettings(warmup=0, warmup_seconds=0, max_warmup=0,
                                                         min_pairs=4, max_pairs=4))
    assert order == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert m.pairs == 4 and m.speedup == pytest.approx(2.0)


def test_measure_stops_early_once_conclusive():
    a, b = Step(lambda: None, (), "a"), Step(lambda: None, ("x",), "b")
    m = measure(a, b, clock=ControlledClock({"x": 0.5}), min_speedup=1.03,
                settings=GateSettings(warmup=0, warmup_seconds=0, max_warmup=0, min_pairs=5,
                                      max_pairs=50))
    assert m.pairs == 5 and not math.isnan(m.speedup)


WHOLE = GateSettings(warmup=0, warmup_seconds=0, max_warmup=0, min_pairs=8, max_pairs=40)


def _whole_step(clock, min_speedup=1.05):
    a, b = Step(lambda: None, (), "a"), Step(lambda: None, ("x",), "b")
    return measure(a, b, clock=clock, settings=WHOLE, min_speedup=min_speedup,
                   early=clearly_one_way(min_speedup, WHOLE))


@pytest.mark.parametrize("cost, kept", [(0.5, True), (2.0, False)])
def test_a_whole_step_decision_far_past_the_line_stops_at_its_few_pairs(cost, kept):
    m = _whole_step(ControlledClock({"x": cost}))
    assert m.decided_early and m.pairs == WHOLE.step_early_pairs < WHOLE.min_pairs
    assert m.storable(WHOLE.min_pairs)  # answered: worth a knowledge-base entry
    assert decide(m, 1.05)[0] is kept


def test_a_whole_step_decision_near_the_line_takes_its_fewest_pairs():
    m = _whole_step(ControlledClock({"x": 1 / 1.12}))  # 1.12x: past 1.05, not by 10 %
    assert not m.decided_early and m.pairs >= WHOLE.min_pairs
    assert decide(m, 1.05)[0]


def test_bursts_of_load_never_give_an_early_keep():
    # truly the same speed; another process's load slows half the samples, of either variant,
    # by 1.2-3x: flagged or not, an early verdict would be a keep the load made up
    for seed in range(40):
        rng = random.Random(seed)
        clock = ControlledClock({"x": 1.0}, interference=lambda call, step: (
            rng.uniform(1.2, 3.0) if rng.random() < 0.5 else 1.0))
        m = _whole_step(clock)
        assert not m.decided_early, seed
        assert not decide(m, 1.05)[0], seed


def test_samples_of_one_variant_that_disagree_are_no_early_verdict():
    # every pair 2x, but the baseline's samples spread 1.0-1.3x among themselves: measured on
    spread = iter([1.0, 1.3, 1.15, 1.0, 1.3, 1.15, 1.0, 1.3] * 10)
    clock = ControlledClock({"x": 0.5}, jitter=0.0,
                            interference=lambda call, step: 1.0 if step.passes else next(spread))
    m = _whole_step(clock)
    assert not m.decided_early and m.pairs >= WHOLE.min_pairs


def _cut_short(monkeypatch, clock, pairs=4):
    """A whole-step measurement whose deadline ends it after ``pairs`` pairs: perf_counter is a
    counter each sample advances by 0.1 s."""
    now = [0.0]
    monkeypatch.setattr(gate, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def tick():
        now[0] += 0.1
    a, b = Step(tick, (), "a"), Step(tick, ("x",), "b")
    return measure(a, b, clock=clock, settings=WHOLE, min_speedup=1.05, deadline=0.2 * pairs + 0.05,
                   early=clearly_one_way(1.05, WHOLE))


def test_cut_short_a_verdict_where_every_sample_of_one_variant_is_apart_from_the_others(monkeypatch):
    # every pair 2x, the baseline's samples spread 1.0-1.3x (no early verdict: they disagree):
    # the deadline ends the pairs at four, every baseline sample past every candidate one
    spread = iter([1.0, 1.3, 1.15, 1.0, 1.3, 1.15, 1.0, 1.3] * 10)
    clock = ControlledClock({"x": 0.5}, jitter=0.0,
                            interference=lambda call, step: 1.0 if step.passes else next(spread))
    m = _cut_short(monkeypatch, clock)
    assert m.pairs == 4 and m.decided_out_of_time and not m.out_of_time and not m.decided_early
    keep, reason = decide(m, 1.05)
    assert keep and "the time budget ended the pairs" in reason
    assert not m.storable(WHOLE.min_pairs)  # a verdict, not a knowledge-base entry


def test_cut_short_samples_that_overlap_are_no_verdict(monkeypatch):
    # 1.6x a pair, but one candidate sample slower than a baseline one: "not reached", as before
    spread = iter([1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0] * 10)
    clock = ControlledClock({"x": 0.6}, jitter=0.0, interference=lambda call, step: next(spread))
    m = _cut_short(monkeypatch, clock)
    assert m.out_of_time and not m.decided_out_of_time
    assert decide(m, 1.05) == (False, "not reached: the time budget ran out after 4 pair(s)")


def test_cut_short_bursts_of_load_never_give_a_keep(monkeypatch):
    for seed in range(40):
        rng = random.Random(seed)
        clock = ControlledClock({"x": 1.0}, interference=lambda call, step: (
            rng.uniform(1.2, 3.0) if rng.random() < 0.5 else 1.0))
        m = _cut_short(monkeypatch, clock, pairs=5)
        assert not decide(m, 1.05)[0], seed


def test_optimize_decides_a_whole_step_pass_far_past_the_line_on_its_few_pairs(mlp):
    model, x = mlp
    gate = dataclasses.replace(QUICK, min_pairs=8, max_pairs=12)
    fast = rewriter.optimize(model, (x,), passes=[StepRelu("s")], clock=ControlledClock({"s": 0.5}),
                             gate=gate, profile=False, progress=False, knowledge_base=False)
    d = _decision(fast, "s")
    assert d.kept and d.scope == "step" and d.measurement["pairs"] == gate.step_early_pairs


REGION = GateSettings(warmup=0, warmup_seconds=0, max_warmup=0, min_pairs=10, max_pairs=120,
                      budget_seconds=60.0)


def _on_the_line(enough=None, costs=1 / 1.05, seed=0, jitter=0.01):
    clock = ControlledClock({"x": costs}, jitter=jitter)
    clock.rng.seed(seed)
    a, b = Step(lambda: None, (), "a"), Step(lambda: None, ("x",), "b")
    return measure(a, b, clock=clock, settings=REGION, min_speedup=1.05, enough=enough)


def test_a_region_on_the_line_stops_once_its_figures_lie_within_the_band():
    # truly 1.05x, the margin itself: more pairs only say which side of the line a figure on
    # it falls; the band stops there, the plain rule measures on (to its budget)
    band = conclusive_or_on_the_line(1.05, 0.02, 2.0)
    for seed in range(5):
        plain, banded = _on_the_line(seed=seed), _on_the_line(band, seed=seed)
        s, n = banded.speedup, banded.noise
        assert REGION.min_pairs <= banded.pairs < plain.pairs, seed
        assert s + 2 * n <= 1.07, seed


def test_a_region_a_little_short_of_the_line_stops_once_it_cannot_be_past_the_band():
    # truly 1.03x, samples spread +-10 %: the plain rule measures until the noise proves it
    # short of 1.05 (1.03 + 2 noise widths under 1.05), the band until 3 widths above its
    # figure lie under 1.07: rejected either way, on fewer pairs
    band = conclusive_or_on_the_line(1.05, 0.02, 2.0)
    plain = [_on_the_line(costs=1 / 1.03, seed=seed, jitter=0.1) for seed in range(5)]
    banded = [_on_the_line(band, costs=1 / 1.03, seed=seed, jitter=0.1) for seed in range(5)]
    assert all(REGION.min_pairs <= b.pairs <= p.pairs for b, p in zip(banded, plain))
    assert sum(b.pairs for b in banded) < 0.9 * sum(p.pairs for p in plain)
    assert not any(decide(m, 1.05)[0] for m in banded + plain)


def test_a_region_that_may_be_past_the_band_is_measured_on():
    # truly 1.08x, past the line and its band: kept, as under the plain rule
    for seed in range(20):
        m = _on_the_line(conclusive_or_on_the_line(1.05, 0.02, 2.0), costs=1 / 1.08, seed=seed, jitter=0.1)
        assert decide(m, 1.05)[0], seed


@pytest.mark.parametrize("cost, kept", [(1 / 1.15, True), (1 / 0.95, False)])
def test_the_band_leaves_a_region_clear_of_the_line_to_the_usual_rule(cost, kept):
    m = _on_the_line(conclusive_or_on_the_line(1.05, 0.02, 2.0), costs=cost)
    assert m.pairs == REGION.min_pairs and decide(m, 1.05)[0] is kept


def test_a_pair_that_would_end_past_the_deadline_is_not_started(monkeypatch):
    # A time budget is a bound: with 0.25 s pairs (a 0.125 s step twice) and the deadline at
    # 1 s, the fourth pair ends on it and a fifth would end past it.
    import types

    from rewriter.decide import gate
    now = [0.0]
    monkeypatch.setattr(gate, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class FakeClock:
        def time(self, step):
            now[0] += 0.125
            return 0.125 * (0.9 if step.passes else 1.0)
    never = GateSettings(warmup=0, max_warmup=0, warmup_seconds=0.0, min_pairs=2, max_pairs=40,
                         budget_seconds=100.0)
    m = measure(Step(lambda: None, (), "a"), Step(lambda: None, ("b",), "b"), clock=FakeClock(),
                settings=never, deadline=1.0, enough=lambda m: False)
    assert m.pairs == 4 and now[0] <= 1.0 and not m.out_of_time
    # before its fewest pairs, a comparison the deadline cuts short says so
    now[0] = 0.0
    m = measure(Step(lambda: None, (), "a"), Step(lambda: None, ("b",), "b"), clock=FakeClock(),
                settings=dataclasses.replace(never, min_pairs=10), deadline=1.0, enough=lambda m: False)
    assert m.pairs == 4 and m.out_of_time


def test_a_warm_up_round_that_would_end_past_the_deadline_is_not_started(monkeypatch):
    # Warming up two 0.4 s steps: the first round ends at 0.8 s, a second would end past the
    # 1 s deadline, so the comparison is out of time before any pair, and says so.
    import types

    from rewriter.decide import gate
    now = [0.0]
    monkeypatch.setattr(gate, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    runs = []

    def step(name):
        return Step(lambda: runs.append(name) or now.__setitem__(0, now[0] + 0.4), (), name)

    class NoClock:
        def time(self, step):
            raise AssertionError("nothing may be timed after a cut-short warm-up")
    settings = GateSettings(warmup=3, max_warmup=3, warmup_seconds=0.0, min_pairs=2)
    m = measure(step("a"), step("b"), clock=NoClock(), settings=settings, deadline=1.0)
    assert runs == ["a", "b"] and m.out_of_time and m.pairs == 0
    assert decide(m, 1.05) == (False, "not reached: the time budget ran out after 0 pair(s)")
    assert m.to_dict()["speedup"] is None and m.to_dict()["noise"] is None  # what reports show
    # with time for it, the warm-up runs its rounds
    now[0], runs[:] = 0.0, []
    timed = []

    class CountingClock:
        def time(self, step):
            timed.append(step.label)
            return 0.1
    m = measure(step("a"), step("b"), clock=CountingClock(), settings=settings, deadline=100.0)
    assert runs[:6] == ["a", "b"] * 3 and not m.out_of_time and len(timed) >= 4


def test_on_a_device_whose_first_run_is_cold_the_step_is_timed_again_warm(monkeypatch):
    """A device's first run loads its kernels: the step every "negligible" share is taken of
    is the warm one (a GPU's reference run took 930 ms for an 18 ms step)."""
    import time as _time

    import rewriter
    from rewriter import pipeline
    from rewriter.devices.backends import CpuBackend
    from tests.models import ReluMLP

    class ColdFirstRun(CpuBackend):
        cold_first_run = True

    class SlowOnce(ReluMLP):
        calls = 0

        def forward(self, x):
            SlowOnce.calls += 1
            if SlowOnce.calls == 1:
                _time.sleep(0.5)  # the first run's kernel loading
            return super().forward(x)
    seen = {}
    real = pipeline.Run._fit_budget_to_the_run

    def spy(self):
        seen["step"] = self.step_seconds
        return real(self)
    monkeypatch.setattr(pipeline.Run, "_fit_budget_to_the_run", spy)
    for backend in (CpuBackend(), ColdFirstRun()):
        SlowOnce.calls = 0
        torch.manual_seed(0)
        rewriter.optimize(SlowOnce(), (torch.randn(8, 16),), passes=[], device=backend, progress=False,
                          profile=False, gate=QUICK, knowledge_base=False)
        seen[type(backend).__name__] = seen.pop("step")
    assert seen["CpuBackend"] >= 0.5 > seen["ColdFirstRun"]


def test_a_slow_sample_is_flagged_unless_its_own_page_faults_account_for_it():
    base = [0.010, 0.030, 0.010, 0.030, 0.010, 0.010, 0.010, 0.010]
    cand = [0.008, 0.008, 0.008, 0.008, 0.008, 0.024, 0.008, 0.008]
    quiet = Measurement(base, cand, outlier_factor=1.5)  # no counts: every slow sample flagged
    assert quiet.flagged == [False, True, False, True, False, True, False, False]
    counted = Measurement(base, cand, outlier_factor=1.5,
                          baseline_faults=[30, 8000, 25, 7990, 30, 28, 30, 26],
                          candidate_faults=[10, 12, 11, 10, 300, 12, 10, 11])
    # the original's two slow samples mapped fresh memory: its cost, kept in; the candidate's
    # slow sample took no more faults than usual (load from elsewhere), and 300 faults on a
    # fast sample explain nothing
    assert counted.flagged == [False, False, False, False, False, True, False, False]
    assert counted.slow_with_own_faults == 2 and counted.pairs == 7
    keep, reason = decide(counted, 1.05)
    assert keep and "2 slow sample(s) kept in: their own page faults" in reason
