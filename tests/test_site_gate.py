"""Site-level gating: regions, signatures, the knowledge base, busy machines, the step check.

Every decision here is made with a controlled clock (tests/controlled.py): times are set by
the passes a variant contains, so the tests check decisions, never wall-clock speed.
"""
import itertools
import random
import time

import pytest
import torch
import torch.nn.functional as F

import rewriter
from rewriter.capture.region import find_regions
from rewriter.decide.gate import GateSettings, Measurement, Step, decide, measure
from tests.controlled import QUICK, Bf16Cpu, ControlledClock, RewriteRelu, StepRelu
from tests.models import Blocks, ReluMLP


def _opt(model, inputs, passes, clock, **kw):
    kw.setdefault("knowledge_base", False)
    kw.setdefault("compile", False)  # the passes' decisions only (the compile row: test_compile_gate)
    return rewriter.optimize(model, inputs, passes=passes, clock=clock, gate=QUICK,
                             profile=False, progress=False, **kw)


def _decision(fast, name):
    return next(d for d in fast.report.decisions if d.pass_name == name)


def _region_samples(clock, name):
    return sum(1 for passes, scope in zip(clock.seen, clock.scopes) if scope == "region" and name in passes)


def _blocks():
    torch.manual_seed(0)
    return Blocks(n=4).eval(), torch.randn(8, 16)


@pytest.fixture
def blocks():
    return _blocks()


def test_identical_sites_are_one_signature_measured_once(blocks):
    model, x = blocks
    clock = ControlledClock({"a": 0.5})
    fast = _opt(model, (x,), [RewriteRelu("a")], clock)
    d = _decision(fast, "a")
    assert d.kept and d.scope == "site" and len(d.sites) == 4
    assert len(d.regions) == 1 and d.regions[0]["sites"] == 4 and d.regions[0]["source"] == "measured"
    # one comparison for the four sites: QUICK takes at most 6 pairs, plus 3 calibration runs
    assert 0 < _region_samples(clock, "a") <= QUICK.max_pairs
    assert d.regions[0]["saved_ms_per_step"] == pytest.approx(4 * d.regions[0]["region_ms_before"] / 2,
                                                              rel=0.05)


def test_a_deep_stack_of_identical_sites_verifies_a_sample_then_the_whole_model(monkeypatch):
    # Verifying costs the same at any depth: first, middle and last of ten identical sites
    # against float64; the composed model is then verified whole once.
    import rewriter.decide.regions as decide_regions
    import rewriter.pipeline as pipeline
    torch.manual_seed(0)
    model, x = Blocks(n=10).eval(), torch.randn(8, 16)
    checked, whole = [], []
    real_region, real_whole = decide_regions.verify_region, pipeline.Run._verify_candidate
    monkeypatch.setattr(decide_regions, "verify_region", lambda r, *a, **k: checked.append(r.label) or real_region(r, *a, **k))
    monkeypatch.setattr(pipeline.Run, "_verify_candidate",
                        lambda self, composed=False: whole.append(composed) or real_whole(self, composed))
    fast = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}))
    d = _decision(fast, "a")
    assert d.kept and d.regions[0]["sites"] == 10 and d.regions[0]["verified_sites"] == 3
    assert len(checked) == 3 and len(set(checked)) == 3
    assert "3 of 10 sites checked" in d.regions[0]["verification"]
    assert True in whole  # the composed model, verified whole
    torch.testing.assert_close(fast(x), model(x))


def test_sites_of_different_shapes_are_different_signatures():
    torch.manual_seed(0)

    class TwoWidths(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

        def forward(self, x):
            return torch.relu(self.b(torch.relu(self.a(x))))
    fast = _opt(TwoWidths().eval(), (torch.randn(4, 16),), [RewriteRelu("a")], ControlledClock({"a": 0.5}))
    d = _decision(fast, "a")
    assert [row["sites"] for row in d.regions] == [1, 1]
    assert {tuple(row["boundary"]) for row in d.regions} == {("float32[4, 32]s[32, 1]",),
                                                              ("float32[4, 8]s[8, 1]",)}


def test_a_cached_signature_is_replayed_without_measuring(tmp_path, blocks):
    model, x = blocks
    kb = tmp_path / "kb.json"
    first = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}), knowledge_base=kb)
    assert _decision(first, "a").regions[0]["source"] == "measured" and kb.exists()
    clock = ControlledClock({"a": 0.5})
    second = _opt(model, (x,), [RewriteRelu("a")], clock, knowledge_base=kb)
    d = _decision(second, "a")
    assert d.kept and d.regions[0]["source"] == "knowledge base" and "knowledge base" in d.reason
    assert _region_samples(clock, "a") == 0
    # another model with the same region (same shapes) reuses it too
    torch.manual_seed(1)
    other = Blocks(n=2).eval()
    clock = ControlledClock({"a": 0.5})
    third = _opt(other, (x,), [RewriteRelu("a")], clock, knowledge_base=kb)
    assert _decision(third, "a").regions[0]["source"] == "knowledge base"
    assert _region_samples(clock, "a") == 0


def test_figures_timed_an_older_way_are_measured_again_not_replayed(tmp_path, blocks, monkeypatch):
    import rewriter.decide.regions as decide_regions
    model, x = blocks
    kb = tmp_path / "kb.json"
    monkeypatch.setattr(decide_regions, "REGION_TIMING", "1")
    old = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 2.0}), knowledge_base=kb)
    assert _decision(old, "a").regions[0]["source"] == "measured"
    replayed = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}), knowledge_base=kb)
    assert _decision(replayed, "a").regions[0]["source"] == "knowledge base"  # it was stored
    monkeypatch.undo()
    clock = ControlledClock({"a": 0.5})
    again = _opt(model, (x,), [RewriteRelu("a")], clock, knowledge_base=kb)
    d = _decision(again, "a")
    assert d.kept and d.regions[0]["source"] == "measured" and _region_samples(clock, "a") > 0


def test_figures_timed_under_an_older_precision_pass_are_measured_again(tmp_path, blocks, monkeypatch):
    """With dtype=bf16 a region's two forms are timed with cast_to_half's casts in: figures
    timed under another version of it are not replayed."""
    from passes.cast_to_half import CastToHalf
    from tests.controlled import Bf16Cpu
    model, x = blocks
    kb = tmp_path / "kb.json"

    def run(costs):
        clock = ControlledClock(costs)
        fast = _opt(model, (x,), [RewriteRelu("a"), "cast_to_half"], clock, knowledge_base=kb,
                    dtype=torch.bfloat16, device=Bf16Cpu())
        return _decision(fast, "a").regions[0]["source"], _region_samples(clock, "a")

    monkeypatch.setattr(CastToHalf, "version", CastToHalf.version - 1)
    assert run({"a": 0.5, "cast_to_half": 0.7})[0] == "measured"
    assert run({"a": 0.5, "cast_to_half": 0.7})[0] == "knowledge base"  # it was stored
    monkeypatch.undo()
    source, samples = run({"a": 0.5, "cast_to_half": 0.7})
    assert source == "measured" and samples > 0


def test_a_rejection_in_the_knowledge_base_is_replayed_as_a_rejection(tmp_path, blocks):
    model, x = blocks
    kb = tmp_path / "kb.json"
    _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 2.0}), knowledge_base=kb)
    again = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}), knowledge_base=kb)
    d = _decision(again, "a")
    assert not d.kept and "slower" in d.reason and d.regions[0]["source"] == "knowledge base"


def test_a_rejection_in_the_knowledge_base_is_neither_recorded_nor_verified(tmp_path, blocks,
                                                                             monkeypatch):
    # Replaying a rejection decides nothing new: the run records no boundary values and verifies
    # no region for it. A kept signature is still verified on this model's values.
    import rewriter.decide.regions as decide_regions
    import rewriter.pipeline as pipeline
    model, x = blocks
    kb = tmp_path / "kb.json"
    _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 2.0}), knowledge_base=kb)
    _opt(model, (x,), [RewriteRelu("b")], ControlledClock({"b": 0.5}), knowledge_base=kb)
    recorded, verified = [], []
    real_record, real_region = pipeline.Run._record, decide_regions.verify_region
    monkeypatch.setattr(pipeline.Run, "_record",
                        lambda self, regions: recorded.append(len(regions)) or real_record(self, regions))
    monkeypatch.setattr(decide_regions, "verify_region",
                        lambda r, *a, **k: verified.append(r.pass_name) or real_region(r, *a, **k))
    rejected = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}), knowledge_base=kb)
    row = _decision(rejected, "a").regions[0]
    assert not row["kept"] and row["source"] == "knowledge base" and "slower" in row["reason"]
    assert recorded == [] and verified == []
    assert row["ran_in"] == "float32" and row["verification"].startswith("not run")
    assert row["max_abs_error"] is None and _decision(rejected, "a").max_abs_error is None
    lines = [l for l in rejected.report.to_markdown().splitlines() if l.startswith("| a |")]
    assert any("| - | knowledge base | rejected" in l for l in lines)  # the region row: no error
    kept = _opt(model, (x,), [RewriteRelu("b")], ControlledClock({"b": 0.5}), knowledge_base=kb)
    row = _decision(kept, "b").regions[0]
    assert row["kept"] and row["source"] == "knowledge base"
    assert recorded == [3] and verified == ["b"] * 3  # of its 4 sites, the 3 it is verified on
    torch.testing.assert_close(kept(x), model(x))


def _burst(share):
    """Load from another process: the original region's samples come out 3x slower in
    ``share`` of them, so the replacement only looks faster."""
    rng = random.Random(1)

    def interference(call, step):
        if step.scope == "region" and not step.passes and rng.random() < share:
            return 3.0
        return 1.0
    return interference


def test_injected_interference_is_inconclusive_never_a_keep(blocks):
    model, x = blocks
    clock = ControlledClock({"a": 1.0}, interference=_burst(0.6))  # truly the same speed
    fast = _opt(model, (x,), [RewriteRelu("a")], clock)
    d = _decision(fast, "a")
    assert not d.kept and "inconclusive: the machine was busy" in d.reason
    assert d.measurement["remeasured"] and d.measurement["busy"]


def test_a_slow_original_that_took_its_own_page_faults_is_its_cost_not_a_busy_machine(blocks):
    # The same one-sided slowness as the burst above, but each slow sample of the original
    # mapped fresh memory (8000 page faults: 32 MB), as glibc does for a freshly allocated
    # tensor over its mmap threshold; another process's load does not fault our pages.
    slow = set()
    rng = random.Random(1)

    def allocator(call, step):
        if step.scope == "region" and not step.passes and rng.random() < 0.6:
            slow.add(call)
            return 3.0
        return 1.0

    def faults(call, step):
        return 8000 if call in slow else 20

    model, x = blocks
    clock = ControlledClock({"a": 0.8}, interference=allocator, faults=faults)
    fast = _opt(model, (x,), [RewriteRelu("a")], clock)
    d = _decision(fast, "a")
    assert d.kept and not d.measurement["busy"] and d.measurement["flagged"] == 0
    assert d.measurement["slow_with_own_faults"] > 0 and "their own page faults" in d.reason


def test_an_original_that_maps_fresh_memory_in_some_calls_is_compared_on_means(blocks):
    # The original takes 1.0, or 2.1 when it maps 32 MB afresh (8000 page faults), in two
    # samples of five (mean 1.44); the replacement 1.2 in every one. The median of the ratios
    # (0.83 in three pairs of five) would reject what is 1.2x faster on average, and flip with
    # the share of faulting samples (BERT's loss region: 0.83x, 0.89x, 1.56x).
    pattern = itertools.cycle([False, True, False, True, False])
    slow = set()

    def allocator(call, step):
        if step.scope == "region" and not step.passes and next(pattern):
            slow.add(call)
            return 2.1
        return 1.0

    model, x = blocks
    clock = ControlledClock({"a": 1.2}, interference=allocator, step_costs={"a": 0.9},
                            faults=lambda call, step: 8000 if call in slow else 20)
    fast = _opt(model, (x,), [RewriteRelu("a")], clock)
    d = _decision(fast, "a")
    assert d.kept and d.speedup == pytest.approx(1.44 / 1.2, rel=0.05)
    assert d.measurement["slow_with_own_faults"] > 0 and "means compared" in d.reason


def test_a_few_flagged_samples_are_left_out_and_the_decision_stands():
    m = Measurement([0.010, 0.010, 0.030, 0.010, 0.010, 0.010, 0.010, 0.010],
                    [0.005, 0.005, 0.005, 0.005, 0.005, 0.005, 0.005, 0.005], outlier_factor=1.5)
    assert m.flagged == [False, False, True] + [False] * 5
    assert m.pairs == 7 and m.speedup == pytest.approx(2.0)
    keep, reason = decide(m, 1.05)
    assert keep and "1 flagged sample(s) left out" in reason


def test_measure_retries_once_when_busy_then_gives_up():
    a, b = Step(lambda: None, (), "a"), Step(lambda: None, ("x",), "b")
    calls = []

    class Busy(ControlledClock):
        def time(self, step):
            calls.append(step.label)
            t = super().time(step)
            return t * 4 if step.label == "a" and len(calls) % 4 in (1, 2) else t
    settings = GateSettings(warmup=0, warmup_seconds=0, max_warmup=0, min_pairs=6, max_pairs=6)
    m = measure(a, b, clock=Busy({"x": 1.0}), settings=settings)
    assert m.remeasured and m.busy and len(calls) == 24  # two rounds of six pairs
    assert "inconclusive" in decide(m, 1.05)[1]


def test_reason_figures_agree_with_each_other():
    m = Measurement([0.120, 0.121, 0.119, 0.120], [0.095, 0.160, 0.094, 0.161], outlier_factor=9)
    keep, reason = decide(m, 1.05)
    # the times printed are the baseline's median and that divided by the ratio printed
    assert m.candidate_ms == pytest.approx(m.baseline_ms / m.speedup)
    assert f"{m.speedup:.3f}x" in reason and f"-> {m.candidate_ms:.3f} ms" in reason


def test_composed_rounding_reverts_the_pass_whose_removal_alone_verifies_not_the_newest(blocks):
    """a and b each nudge the ReLUs within the fp32 bound on their own, past it together; c is
    exact and decided last. The composed model fails verification: of a and b (either one's
    removal verifies), b, predicted to save less, is taken off; c, newest but innocent, stays."""
    model, x = blocks
    clock = ControlledClock({"a": 0.5, "b": 0.8, "c": 0.9})
    passes = [RewriteRelu("a", shift=2.2e-6), RewriteRelu("b", shift=2.2e-6), RewriteRelu("c")]
    fast = _opt(model, (x,), passes, clock)
    assert _decision(fast, "a").kept and _decision(fast, "c").kept, fast.report.final["reason"]
    b = _decision(fast, "b")
    assert b.status == "reverted" and "failed verification" in b.reason
    assert fast.report.kept_passes == ["a", "c"]
    assert fast.report.final["reason"].startswith("reverted before timing: b (the composed model failed verification")
    model, x = _blocks()  # the same model afresh
    alone = _opt(model, (x,), [RewriteRelu("a", shift=2.2e-6)], ControlledClock({"a": 0.5}))
    assert alone.report.kept_passes == ["a"]  # the shift alone is within the bound


def test_a_composed_regression_is_resolved_by_ablation_most_doubtful_first(blocks):
    model, x = blocks
    # a: 2x on its region; b: 1.25x on its region but the step with it is slower
    clock = ControlledClock({"a": 0.5, "b": 0.8}, step_costs={"a": 0.9, "b": 1.5})
    fast = _opt(model, (x,), [RewriteRelu("a"), RewriteRelu("b")], clock)
    a, b = _decision(fast, "a"), _decision(fast, "b")
    assert a.kept and not b.kept and b.status == "reverted"
    final = fast.report.final
    assert final["kept"] and final["reverted"] == [b.regions[0] and "b [" + b.regions[0]["signature"][:8] + "]"]
    assert "reverted by ablation" in final["reason"] and fast.report.kept_passes == ["a"]


def test_a_faster_region_is_kept_when_the_step_cannot_resolve_it(blocks):
    model, x = blocks
    clock = ControlledClock({"a": 0.5}, step_costs={"a": 1.0})  # the step shows nothing
    fast = _opt(model, (x,), [RewriteRelu("a")], clock)
    assert _decision(fast, "a").kept and fast.report.kept_passes == ["a"]
    final = fast.report.final
    assert final["kept"] and "cannot resolve the predicted saving" in final["reason"]
    assert final["predicted_saving_ms"] > 0


def _step_pairs(clock):
    return sum(1 for scope in clock.scopes if scope == "step") // 2


def test_the_step_check_takes_its_fewest_pairs_unless_they_point_to_a_regression(blocks):
    model, x = blocks
    # the step shows no regression: the fewest pairs answer the question
    quiet = ControlledClock({"a": 0.5}, step_costs={"a": 1.0})
    assert _opt(model, (x,), [RewriteRelu("a")], quiet).report.final["kept"]
    assert _step_pairs(quiet) == QUICK.min_pairs
    # the step points 3 % slower inside a wide noise: more pairs before any ablation
    # (jitter 0.2: no sample is ever over 1.5x its variant's lower decile, none is flagged)
    unclear = ControlledClock({"a": 0.5}, step_costs={"a": 1.05}, jitter=0.2)
    fast = _opt(model, (x,), [RewriteRelu("a")], unclear)
    assert _step_pairs(unclear) > QUICK.min_pairs
    m = fast.report.final["measurement"]
    assert not m["remeasured"] and m["pairs"] == _step_pairs(unclear)


def test_a_composed_step_faster_in_every_pair_is_answered_on_two_pairs(blocks):
    model, x = blocks
    clock = ControlledClock({"a": 0.5}, step_costs={"a": 0.5})  # the step is 2x too
    fast = _opt(model, (x,), [RewriteRelu("a")], clock)
    assert _step_pairs(clock) == QUICK.confirm_unanimous_pairs == 2
    final = fast.report.final
    assert final["kept"] and "confirmed on the whole step" in final["reason"] and "over 2 pairs" in final["reason"]
    # a flagged sample among the first pairs (a burst of load): no early answer, the fewest pairs
    step_samples = []

    def burst(call, step):
        if step.scope == "step":
            step_samples.append(call)
        return 3.0 if step.scope == "step" and len(step_samples) == 1 else 1.0

    loaded = ControlledClock({"a": 0.5}, step_costs={"a": 0.5}, interference=burst)
    fast = _opt(model, (x,), [RewriteRelu("a")], loaded)
    assert _step_pairs(loaded) == QUICK.min_pairs
    assert fast.report.final["kept"] and fast.report.final["measurement"]["flagged"] == 1


def test_a_regression_that_a_second_step_check_does_not_show_reverts_nothing(blocks):
    model, x = blocks
    composed = []

    def drift(call, step):  # the composed step's first 6 pairs run while the machine is slower
        if step.scope == "step" and step.passes:
            composed.append(call)
            return 1.3 if len(composed) <= QUICK.max_pairs else 1.0
        return 1.0

    clock = ControlledClock({"a": 0.5}, step_costs={"a": 1.0}, interference=drift)
    fast = _opt(model, (x,), [RewriteRelu("a")], clock)
    final = fast.report.final
    assert final["kept"] and not final["reverted"] and fast.report.kept_passes == ["a"]
    assert "a second measurement did not show" in final["reason"]
    assert _step_pairs(clock) == QUICK.max_pairs + final["measurement"]["pairs"]


def test_a_step_check_that_led_to_an_ablation_is_measured_again_next_time(tmp_path, blocks):
    model, x = blocks
    kb = tmp_path / "kb.json"
    costs = dict(costs={"a": 0.5, "b": 0.8}, step_costs={"a": 0.9, "b": 1.5})
    first = _opt(model, (x,), [RewriteRelu("a"), RewriteRelu("b")], ControlledClock(**costs),
                 knowledge_base=kb)
    assert first.report.final["reverted"]
    clock = ControlledClock(**costs)
    again = _opt(model, (x,), [RewriteRelu("a"), RewriteRelu("b")], clock, knowledge_base=kb)
    # the regions come from the knowledge base, the step check is timed: b is reverted again
    assert _decision(again, "b").regions[0]["source"] == "knowledge base"
    assert _step_pairs(clock) > 0 and again.report.final.get("source") != "knowledge base"
    assert again.report.kept_passes == ["a"] and "reverted by ablation" in again.report.final["reason"]


def test_a_region_too_cheap_to_matter_is_not_measured_against_its_replacement(blocks):
    import dataclasses
    model, x = blocks
    # one call of the original region: 1 microsecond; 4 sites cannot save half of any step
    clock = ControlledClock({"a": 0.5}, base=1e-6)
    gate = dataclasses.replace(QUICK, negligible=0.5)
    fast = rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=clock, gate=gate,
                             profile=False, progress=False, knowledge_base=False)
    d = _decision(fast, "a")
    assert not d.kept and d.status == "rejected" and d.reason.startswith("region, 4 site(s): negligible")
    assert "not measured against its replacement" in d.reason
    region_samples = [p for p, scope in zip(clock.seen, clock.scopes) if scope == "region"]
    assert region_samples == [()] * 3  # three runs of the original, the replacement never timed


def test_a_negligible_region_is_remembered_and_judged_against_each_runs_step(tmp_path, blocks,
                                                                              monkeypatch):
    # The original's time is stored; a later run replays "negligible" without recording or
    # timing anything, and a run in which the region is not negligible compares it.
    import dataclasses

    import rewriter.pipeline as pipeline
    model, x = blocks
    kb = tmp_path / "kb.json"
    gate = dataclasses.replace(QUICK, negligible=0.5)

    def run(gate, clock):
        return rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=clock, gate=gate,
                                 profile=False, progress=False, knowledge_base=kb)
    first = run(gate, ControlledClock({"a": 0.5}, base=1e-6))
    row = _decision(first, "a").regions[0]
    assert row["source"] == "measured" and row["reason"].startswith("negligible")
    recorded = []
    real_record = pipeline.Run._record
    monkeypatch.setattr(pipeline.Run, "_record",
                        lambda self, regions: recorded.append(len(regions)) or real_record(self, regions))
    clock = ControlledClock({"a": 0.5}, base=1e-6)
    again = run(gate, clock)
    row = _decision(again, "a").regions[0]
    assert not row["kept"] and row["source"] == "knowledge base" and "negligible" in row["reason"]
    assert recorded == [] and _region_samples(clock, "a") == 0
    assert [scope for scope in clock.scopes if scope == "region"] == []
    clock = ControlledClock({"a": 0.5}, base=1e-6)
    wider = run(dataclasses.replace(gate, negligible=0.0), clock)  # now every region matters
    row = _decision(wider, "a").regions[0]
    assert row["source"] == "measured" and recorded == [3] and _region_samples(clock, "a") > 0


def test_a_suspected_regression_is_measured_on_twice_the_fewest_pairs_before_any_ablation(blocks):
    import dataclasses
    model, x = blocks
    gate = dataclasses.replace(QUICK, max_pairs=20)
    clock = ControlledClock({"a": 0.5}, step_costs={"a": 1.5})  # clearly slower on the step
    fast = rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=clock, gate=gate,
                             profile=False, progress=False, knowledge_base=False)
    assert not fast.report.final["kept"] and "slower" in fast.report.final["reason"]
    first = fast.report.final["reason"]
    assert f"over {2 * gate.confirm_pairs} pairs" in first  # not the 4 a quiet answer takes


def test_a_suspected_regression_the_firm_pairs_do_not_show_is_not_measured_on(blocks):
    # A composed step 8% slower under a step noise of +-10% a sample: below the floor on the
    # usual pairs, so the check takes its firm pairs, and they answer it: not clear of the
    # noise, so nothing is reverted (it is not measured on until the figures cross the line).
    import dataclasses
    model, x = blocks
    gate = dataclasses.replace(QUICK, max_pairs=40)
    clock = ControlledClock({"a": 0.5}, step_costs={"a": 1.08}, jitter=0.1)
    fast = rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=clock, gate=gate,
                             profile=False, progress=False, knowledge_base=False)
    final = fast.report.final
    assert final["kept"] and not final["reverted"] and _decision(fast, "a").kept
    assert final["measurement"]["pairs"] == 2 * gate.confirm_pairs
    assert final["speedup"] < gate.regression  # it did suspect one


def _optimizer_only(d=16, gate=QUICK, **kw):
    """optimize() with no passes over a ReluMLP and its AdamW, whose fused form the controlled
    clock makes 0.3x on its own step (and no faster on the whole step)."""
    torch.manual_seed(0)
    model = ReluMLP(d).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    clock = ControlledClock({"fuse_optimizer": 0.3}, step_costs={"fuse_optimizer": 1.0})
    fast, returned = rewriter.optimize(model, (torch.randn(4, d),), optimizer=opt, passes=[],
                                       clock=clock, gate=gate, loss_fn=lambda out: out.pow(2).mean(),
                                       profile=False, progress=False, **kw)
    return fast, opt, returned, clock


def test_fused_optimizer_faster_on_its_step_is_returned_with_no_passes():
    fast, opt, opt2, _ = _optimizer_only(knowledge_base=False)
    d = _decision(fast, "fuse_optimizer")
    assert d.kept and "on its own step" in d.reason
    assert fast.report.final["kept"] and opt2 is opt and opt.param_groups[0]["fused"]


def test_optimizer_figures_timed_an_older_way_are_measured_again_not_replayed(tmp_path, monkeypatch):
    import rewriter.decide.optimizer_gate as optimizer_gate

    def once():
        fast, _, _, clock = _optimizer_only(knowledge_base=tmp_path)
        return _decision(fast, "fuse_optimizer"), sum(1 for s in clock.scopes if s == "optimizer")

    monkeypatch.setattr(optimizer_gate, "OPTIMIZER_TIMING", "1")
    old, timed_old = once()
    replayed, timed_replayed = once()
    assert timed_old > 0 and timed_replayed == 0 and "knowledge base" in replayed.reason  # stored
    monkeypatch.undo()
    again, timed_again = once()
    assert again.kept and timed_again > 0 and "knowledge base" not in again.reason


def test_the_optimizer_step_warms_up_for_a_regions_time_not_a_whole_steps(monkeypatch):
    # Whole steps warm up for warmup_seconds (here a minute, so every one of max_warmup rounds);
    # the optimizer's own step, short like a region, for region_warmup_seconds (here none: only
    # the gate's fewest warm-up rounds).
    import dataclasses

    import rewriter.decide.optimizer_gate as optimizer_gate
    gate = dataclasses.replace(QUICK, warmup=2, max_warmup=10, warmup_seconds=60.0,
                               region_warmup_seconds=0.0)
    runs, pairs = [], []
    real_measure = optimizer_gate.measure

    def counting_measure(baseline, candidate, **kw):
        counted = dataclasses.replace(baseline, run=lambda: runs.append(1) or baseline.run())
        m = real_measure(counted, candidate, **kw)
        pairs.append(len(m.baseline_times))
        return m
    monkeypatch.setattr(optimizer_gate, "measure", counting_measure)
    fast = _optimizer_only(gate=gate, knowledge_base=False)[0]
    assert _decision(fast, "fuse_optimizer").kept
    assert len(pairs) == 1 and len(runs) - pairs[0] == gate.warmup


def test_the_optimizer_timing_is_replayed_from_the_knowledge_base_for_the_same_step(tmp_path):
    def once(d):
        fast, _, _, clock = _optimizer_only(d, knowledge_base=tmp_path)
        timed = sum(1 for scope in clock.scopes if scope == "optimizer")
        return _decision(fast, "fuse_optimizer"), timed

    first, timed_first = once(16)
    again, timed_again = once(16)
    other, timed_other = once(24)  # other parameter shapes: another step, measured afresh
    assert first.kept and timed_first > 0 and "knowledge base" not in first.reason
    assert again.kept and timed_again == 0 and "knowledge base" in again.reason
    assert again.speedup == pytest.approx(first.speedup)
    assert other.kept and timed_other > 0 and "knowledge base" not in other.reason


class SlowFind(RewriteRelu):
    def find(self, gm, ctx):
        time.sleep(0.4)  # elapses the budget; not a timing threshold
        return super().find(gm, ctx)


def test_time_budget_reports_what_it_did_not_reach_and_keeps_nothing_unmeasured(blocks):
    model, x = blocks
    clock = ControlledClock({"a": 0.5, "b": 0.5})
    fast = _opt(model, (x,), [SlowFind("a"), RewriteRelu("b")], clock, time_budget=0.3)
    a, b = _decision(fast, "a"), _decision(fast, "b")
    assert b.status == "not reached" and not b.kept and "time budget" in b.reason
    assert ("b",) not in clock.seen
    assert a.status in ("kept", "not reached")  # a was found; its measurement is past the budget
    assert all(r["status"] == "not reached" for r in a.regions if not r["kept"])


def test_the_report_shows_signatures_and_phases(blocks):
    model, x = blocks
    fast = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}))
    md = fast.report.to_markdown()
    assert "## Regions" in md and "4 sites" in md
    for phase in ("capture", "rewrite", "record", "verify", "measure", "confirm"):
        assert phase in fast.report.phases
    assert "time per phase" in md


def test_regions_cut_out_the_rewritten_nodes_with_their_boundary():
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(ReluMLP())
    from rewriter.capture.front_ends import finish_rewrite
    from rewriter.capture.ir import annotate_tensor_info, copy_graph_module
    x = torch.randn(4, 16)
    annotate_tensor_info(gm, (x,), {})
    cand = copy_graph_module(gm)
    p = RewriteRelu("a")
    sites = p.find(cand, None)
    p.apply(cand, sites, None)
    finish_rewrite(cand)
    regions = find_regions(gm, cand, p.find(copy_graph_module(gm), None), "a", "graph_0")
    assert len(regions) == 1
    r = regions[0]
    assert r.inputs == ["relu"] and r.outputs == ["relu"]
    value = torch.randn(4, 32).relu()
    assert torch.equal(r.before(value)[0], value) and torch.equal(r.after(value)[0], F.relu(value))


def test_a_region_call_draws_its_cotangents_once_not_in_every_timed_call(monkeypatch):
    # The draw (float64 randn) costs about what a region does: inside the timed loop it would
    # add the same milliseconds to both forms and pull every ratio towards 1.
    from rewriter.capture.record import Recorded
    from rewriter.decide import site_gate
    draws = []
    real = site_gate._cotangent
    monkeypatch.setattr(site_gate, "_cotangent", lambda i, t: draws.append(i) or real(i, t))
    gm = torch.fx.symbolic_trace(lambda x: (x.relu() * 3,))
    x = torch.randn(4, 32)
    call = site_gate.RegionCall(gm, [Recorded(x, requires_grad=True)], training=True)
    grads = [call()["grad input 0"] for _ in range(5)]
    site_gate._repeated(call, 3)()  # the timed path
    assert draws == [0]
    want = real(0, x) * 3 * (x > 0)
    for g in grads:
        torch.testing.assert_close(g, want)


def test_with_dtype_regions_are_measured_in_that_precision_and_it_is_decided_with_them(blocks):
    model, x = blocks
    clock = ControlledClock({"a": 0.5, "cast_to_half": 0.5})
    fast = _opt(model, (x,), [RewriteRelu("a"), "cast_to_half"], clock, dtype=torch.bfloat16,
                device=Bf16Cpu())
    names = [d.pass_name for d in fast.report.decisions]
    assert names == ["a", "cast_to_half"] and _decision(fast, "cast_to_half").kept
    a = _decision(fast, "a")
    assert a.kept and a.regions[0]["ran_in"] == "bfloat16"  # recorded in the bf16 graph
    # the precision pass was measured with the kept rewrite in: its step contained "a"
    assert ("a", "cast_to_half") in clock.seen
    assert fast.report.plan["kept_passes"] == ["a", "cast_to_half"]


def test_a_rejected_precision_sends_the_other_passes_back_to_full_precision(blocks):
    model, x = blocks
    clock = ControlledClock({"a": 0.5, "cast_to_half": 2.0})
    fast = _opt(model, (x,), [RewriteRelu("a"), "cast_to_half"], clock, dtype=torch.bfloat16,
                device=Bf16Cpu())
    assert not _decision(fast, "cast_to_half").kept
    a = _decision(fast, "a")
    assert a.kept and a.regions[0]["ran_in"] == "float32"
    assert [d.pass_name for d in fast.report.decisions].count("a") == 1
    assert any("decided again at full precision" in n for n in fast.report.notes)
    assert fast.report.kept_passes == ["a"]


class Fp32OnlyRelu(RewriteRelu):
    full_precision_only = True  # as onednn_linear: a no-op once the graphs run in half


def _beside_precision(cast_cost):
    """optimize(dtype=bf16) of a full-precision-only pass (0.5x) beside cast_to_half (``cast_cost``)."""
    torch.manual_seed(0)
    model, x = Blocks(n=4).eval(), torch.randn(8, 16)
    clock = ControlledClock({"fp32": 0.5, "cast_to_half": cast_cost})
    fast = _opt(model, (x,), [Fp32OnlyRelu("fp32"), "cast_to_half"], clock, dtype=torch.bfloat16,
                device=Bf16Cpu())
    return fast, clock


def test_a_full_precision_only_pass_is_not_tried_under_a_kept_precision():
    fast, clock = _beside_precision(0.5)
    assert _decision(fast, "cast_to_half").kept
    d = _decision(fast, "fp32")
    assert not d.kept and d.status == "not applicable" and "fp32 ops only" in d.reason
    assert _region_samples(clock, "fp32") == 0  # never measured


def test_a_rejected_precision_sends_a_full_precision_only_pass_back_to_be_decided():
    """No other pass had regions under the speculated precision: it is decided again all the same."""
    fast, _ = _beside_precision(2.0)
    assert not _decision(fast, "cast_to_half").kept
    d = _decision(fast, "fp32")
    assert d.kept and d.regions[0]["ran_in"] == "float32"
    assert fast.report.kept_passes == ["fp32"]


def test_a_cpu_without_native_bf16_declines_precision_lowering_with_the_reason(monkeypatch, blocks):
    import rewriter.devices.backends as backends
    monkeypatch.setattr(backends, "cpu_has_native_bf16", lambda: False)
    model, x = blocks
    fast = _opt(model, (x,), ["cast_to_half"], ControlledClock({"cast_to_half": 0.5}),
                dtype=torch.bfloat16)
    d = _decision(fast, "cast_to_half")
    assert d.status == "not applicable" and "bfloat16 is not a fast autocast dtype on cpu" in d.reason


def test_a_region_too_small_to_matter_is_not_kept(blocks):
    model, x = blocks
    # the region "saves" half of a tenth of a microsecond: nothing a step could notice
    fast = _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}, base=1e-7))
    d = _decision(fast, "a")
    assert not d.kept and "negligible" in d.reason


class SlowClock(ControlledClock):
    """Each sample also takes real time, so the budget runs out while measuring."""

    def time(self, step):
        time.sleep(0.05)
        return super().time(step)


def test_the_budget_stops_a_measurement_in_progress_and_nothing_is_kept_from_it(blocks):
    model, x = blocks
    clock = SlowClock({"a": 0.5})
    fast = _opt(model, (x,), [RewriteRelu("a")], clock, time_budget=0.4)
    d = _decision(fast, "a")
    assert not d.kept and "time budget" in d.reason
    assert clock.calls < 40  # stopped, not the 200 pairs a region may take


def test_a_region_near_the_margin_is_measured_within_its_own_budget_then_its_figures_decide(blocks):
    import dataclasses
    model, x = blocks
    # 1.03x with wide noise: never clear of the 1.05 margin, never clearly below it
    clock = SlowClock({"a": 1 / 1.03}, jitter=0.3)
    gate = dataclasses.replace(QUICK, max_pairs=200, region_budget_seconds=0.5)
    fast = rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=clock, gate=gate,
                             profile=False, progress=False, knowledge_base=False)
    d = _decision(fast, "a")
    assert not d.kept and d.status == "rejected"
    m = d.regions[0]["measurement"]
    pairs = m["pairs"] + m["flagged"]  # the pairs taken (a flagged one is left out of the figures)
    assert gate.region_min_pairs <= pairs < 40  # 0.5 s of 0.1 s pairs, not 200 pairs


@pytest.mark.parametrize("base, early", [(0.06, True), (0.01, False)])
def test_a_region_long_enough_to_time_once_gets_a_steps_early_verdict_a_short_one_does_not(blocks, base, early):
    import dataclasses
    model, x = blocks
    gate = dataclasses.replace(QUICK, min_pairs=8, max_pairs=12)
    fast = rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=ControlledClock({"a": 0.5}, base=base),
                             gate=gate, profile=False, progress=False, knowledge_base=False, compile=False)
    d = _decision(fast, "a")
    pairs = d.regions[0]["measurement"]["pairs"]
    assert d.kept
    if early:  # samples like a step's (an LM head's): answered on the step's few pairs
        assert pairs == gate.step_early_pairs
    else:  # short samples: no verdict on a handful
        assert pairs >= max(gate.min_pairs, gate.region_min_pairs)


def _step_samples(clock, name):
    return sum(1 for passes, scope in zip(clock.seen, clock.scopes) if scope == "step" and name in passes)


def test_a_whole_step_decision_is_replayed_from_the_knowledge_base(tmp_path, blocks):
    model, x = blocks
    kb = tmp_path / "kb.json"
    first_clock = ControlledClock({"s": 0.5})
    first = _opt(model, (x,), [StepRelu("s")], first_clock, knowledge_base=kb)
    d = _decision(first, "s")
    assert d.kept and d.scope == "step" and "knowledge base" not in d.reason
    measured = _step_samples(first_clock, "s")
    clock = ControlledClock({"s": 0.5})
    second = _opt(model, (x,), [StepRelu("s")], clock, knowledge_base=kb)
    again = _decision(second, "s")
    assert again.kept and "knowledge base, measured" in again.reason
    assert again.speedup == pytest.approx(d.speedup, rel=1e-5)
    # and so is the step check of the same composed step: no step is timed at all
    assert measured > 0 and _step_samples(clock, "s") == 0
    assert "knowledge base, measured" in second.report.final["reason"]
    assert second.report.final["source"] == "knowledge base"
    # the same ops on tensors of other shapes are another step: measured afresh
    torch.manual_seed(1)
    wider = _opt(Blocks(n=4, d=32).eval(), (torch.randn(8, 32),), [StepRelu("s")],
                 ControlledClock({"s": 0.5}), knowledge_base=kb)
    assert "knowledge base" not in _decision(wider, "s").reason


def test_whole_steps_timed_an_older_way_are_measured_again(tmp_path, blocks, monkeypatch):
    import rewriter.decide.job as job
    model, x = blocks
    kb = tmp_path / "kb.json"
    monkeypatch.setattr(job, "STEP_TIMING", "1")
    _opt(model, (x,), [StepRelu("s")], ControlledClock({"s": 0.5}), knowledge_base=kb)
    assert "knowledge base, measured" in _decision(
        _opt(model, (x,), [StepRelu("s")], ControlledClock({"s": 0.5}), knowledge_base=kb), "s").reason
    monkeypatch.undo()
    clock = ControlledClock({"s": 0.5})
    again = _opt(model, (x,), [StepRelu("s")], clock, knowledge_base=kb)
    assert "knowledge base" not in _decision(again, "s").reason and _step_samples(clock, "s") > 0
    assert again.report.final.get("source") != "knowledge base"


def test_a_regression_is_only_believed_on_firm_pairs():
    """Too few pairs pointing slower (the time budget cut the step check short) revert nothing."""
    from types import SimpleNamespace

    from rewriter.decide.confirm import _slower, firm_pairs
    from rewriter.pipeline import Settings
    run = SimpleNamespace(settings=Settings(gate=GateSettings()))
    g = run.settings.gate

    def slower_on(pairs):
        m = Measurement(baseline_times=[0.10] * pairs, candidate_times=[0.13] * pairs)
        return _slower(m, run)
    assert firm_pairs(g) == 2 * g.confirm_pairs
    assert not slower_on(firm_pairs(g) - 1)
    assert slower_on(firm_pairs(g))
    # under objective="memory" only what is slower than memory_slowdown allowed counts
    run.settings.objective, run.settings.memory_slowdown = "memory", 0.5
    assert not slower_on(firm_pairs(g))


def test_a_region_computing_under_the_bf16_overlay_is_held_to_bf16s_tolerance():
    """Under optimize(dtype=bf16) every region is verified with the precision overlay on: its
    inputs are recorded in fp32 but it computes in bf16, so a replacement that differs by bf16
    rounding (CUDA's flash attention against the written-out one) is right, not off by fp32's
    bound (the first GPU run failed fuse_attention that way)."""
    from types import SimpleNamespace

    from rewriter.capture.record import Recorded
    from rewriter.decide.site_gate import verify_region

    class Exact(torch.nn.Module):
        def forward(self, x, w):
            return (x @ w,)

    class RoundedToBf16(torch.nn.Module):
        def forward(self, x, w):
            return ((x @ w).bfloat16().float(),)
    before, after = torch.fx.symbolic_trace(Exact()), torch.fx.symbolic_trace(RoundedToBf16())
    region = SimpleNamespace(before=before, after=after)
    torch.manual_seed(0)
    values = [Recorded(torch.randn(64, 64)), Recorded(torch.randn(64, 64))]
    fp32 = verify_region(region, values, training=False, forms=(before, after))
    assert not fp32.ok  # fp32's bound: bf16 rounding is far beyond it
    bf16 = verify_region(region, values, training=False, forms=(before, after), precision=torch.bfloat16)
    assert bf16.ok, bf16.problem
    # the precision applies to the overlay's forms only: the region's own stays at fp32's bound
    assert not verify_region(SimpleNamespace(before=before, after=after), values, training=False,
                             precision=torch.bfloat16).ok


def test_past_the_budget_a_region_is_not_verified_either(blocks):
    # `b` computes the wrong numbers: verified, it would fail; past the budget it is not reached,
    # and its float64 verification (seconds for an LM head's region) is not paid
    model, x = blocks
    clock = ControlledClock({"a": 0.5, "b": 0.5})
    fast = _opt(model, (x,), [SlowFind("a"), RewriteRelu("b", shift=1.0)], clock, time_budget=0.3)
    b = _decision(fast, "b")
    assert b.status == "not reached" and "time budget" in b.reason
    assert all(r["status"] == "not reached" and r.get("max_abs_error") is None for r in b.regions)


class _ListClock:
    """Hands out the given sample times in order; counts them."""

    def __init__(self, times):
        self.times, self.taken = list(times), 0

    def time(self, step):
        self.taken += 1
        return self.times.pop(0)


class _NoCall:
    def run(self):
        pass


def test_a_long_original_region_is_timed_once_a_short_one_the_fastest_of_three():
    from rewriter.decide.site_gate import ONE_CALL_IS_ENOUGH_S, one_call_ms
    long_clock = _ListClock([ONE_CALL_IS_ENOUGH_S * 4, 0.001, 0.001])
    assert one_call_ms(_NoCall().run, long_clock) == pytest.approx(1e3 * ONE_CALL_IS_ENOUGH_S * 4)
    assert long_clock.taken == 1
    short_clock = _ListClock([0.003, 0.002, 0.004])
    assert one_call_ms(_NoCall().run, short_clock) == pytest.approx(2.0)
    assert short_clock.taken == 3


def test_a_measurement_stops_where_the_whole_step_check_still_fits_in_the_budget(blocks, monkeypatch):
    from rewriter.decide import regions
    from rewriter.pipeline import Run
    monkeypatch.setattr(Run, "_confirm_reserve", lambda self: 1.5)  # as for a ~0.17 s step
    calls = []
    real = regions.measure_region

    def spy(*args, **kwargs):
        calls.append(kwargs["deadline"] - time.perf_counter())
        return real(*args, **kwargs)
    monkeypatch.setattr(regions, "measure_region", spy)
    model, x = blocks
    _opt(model, (x,), [RewriteRelu("a")], ControlledClock({"a": 0.5}), time_budget=2.0)
    # the region may measure until 1.5 s before the budget's end, not until its end
    assert calls and all(left <= 0.5 for left in calls), calls


@pytest.mark.parametrize("one_call_s, pairs", [(0.06, QUICK.min_pairs), (0.01, QUICK.max_pairs)])
def test_a_region_long_enough_to_be_timed_once_needs_only_a_step_s_fewest_pairs(blocks, one_call_s, pairs):
    # QUICK: a step's fewest pairs 4; a short region's min(region_min_pairs, max_pairs) = 6
    model, x = blocks
    clock = ControlledClock({"a": 0.5}, base=one_call_s)
    _opt(model, (x,), [RewriteRelu("a")], clock)
    assert _region_samples(clock, "a") == pairs


def test_a_region_whose_fewest_pairs_cannot_fit_in_the_budget_left_is_not_started(blocks, monkeypatch):
    # each region call takes 1 s (the controlled clock): its fewest pairs need at least (warm-up +
    # fewest pairs) s, more than a 5 s budget holds; neither verified nor measured, it says so
    from rewriter.decide import regions
    measured, verified = [], []
    real_measure, real_verify = regions.measure_region, regions.verify_region
    monkeypatch.setattr(regions, "measure_region", lambda *a, **k: measured.append(1) or real_measure(*a, **k))
    monkeypatch.setattr(regions, "verify_region", lambda *a, **k: verified.append(1) or real_verify(*a, **k))
    model, x = blocks
    fast = _opt(model, (x,), [RewriteRelu("a"), RewriteRelu("b")], ControlledClock({"a": 0.5, "b": 0.5}, base=1.0),
                time_budget=5.0)
    for name in ("a", "b"):
        d = _decision(fast, name)
        assert d.status == "not reached" and not d.kept, d.reason
        assert all("fewest pairs need at least" in r["reason"] for r in d.regions), d.regions
    assert measured == [] and verified == []


def test_the_least_a_region_comparison_takes_is_its_warm_up_and_fewest_pairs_of_two_samples():
    from rewriter.decide.site_gate import ONE_CALL_IS_ENOUGH_S, least_measuring_seconds
    g = QUICK
    long_call = 2 * ONE_CALL_IS_ENOUGH_S  # timed once: a step's fewest pairs, one call a sample
    # the replacement at its fastest: free for a pass that may save everything, 0.65 of the
    # original for one that saves at most 0.35
    assert least_measuring_seconds(long_call, g) == pytest.approx(long_call * (g.warmup + g.min_pairs))
    assert least_measuring_seconds(long_call, g, saves_at_most=0.35) == pytest.approx(
        1.65 * long_call * (g.warmup + g.min_pairs))
    tiny = 1e-6  # repeated to make a sample of region_sample_seconds; a short region's pairs
    fewest = max(g.min_pairs, min(g.region_min_pairs, g.max_pairs))
    assert least_measuring_seconds(tiny, g) == pytest.approx(g.region_sample_seconds * (g.warmup + fewest))
