"""Regions timed from the heap as the user's step leaves it (rewriter.decide.fresh_heap,
site_gate.heap_as_a_step_leaves_it): where the step maps fresh pages and the region's original
does too, each sample of either form starts from a trimmed heap, untimed; otherwise nothing
changes. Controlled clocks: what is checked is where the trim happens, not what it costs."""
from __future__ import annotations

import types

import pytest
import torch

import rewriter
from rewriter.capture.record import Recorded
from rewriter.decide import fresh_heap, regions, site_gate
from rewriter.decide.fresh_heap import step_maps_fresh_pages
from rewriter.devices.host_memory import trim_heap
from tests.controlled import QUICK, ControlledClock, RewriteRelu
from tests.models import Blocks


def _counter(start=0, per_call=0):
    state = {"n": start}

    def faults():
        return state["n"]

    def run():
        state["n"] += per_call
    return faults, run


@pytest.mark.parametrize("pages, fresh", [(6000, True), (100, False)])
def test_a_step_maps_fresh_pages_when_its_faults_reach_the_bar(pages, fresh):
    faults, run = _counter(per_call=pages)
    assert step_maps_fresh_pages(run, faults=faults, at=5000) is fresh


def test_a_step_that_maps_fresh_pages_only_now_and_then_is_counted_as_mapping_them():
    # glibc hands memory back on some steps, not others: 0 then 8000 pages
    per_call = iter([0, 8000, 0, 0])
    state, calls = {"n": 0}, []

    def run():
        calls.append(1)
        state["n"] += next(per_call)
    assert step_maps_fresh_pages(run, faults=lambda: state["n"], at=5000, tries=3) is True
    assert len(calls) == 2  # stops at the first run that maps them
    quiet = _counter(per_call=100)
    assert step_maps_fresh_pages(quiet[1], faults=quiet[0], at=5000, tries=3) is False


def test_where_faults_are_not_counted_the_answer_is_none():
    ran = []
    assert step_maps_fresh_pages(lambda: ran.append(1), faults=lambda: None) is None and ran == [1]


def test_trimming_the_heap_never_raises():
    big = torch.ones(8 * 2**20 // 4)  # 8 MiB, freed below: something to hand back
    del big
    trim_heap()
    trim_heap()


def _measure(monkeypatch, fresh: bool, region_maps: bool):
    trims, checked = [], []
    monkeypatch.setattr(site_gate, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(site_gate, "maps_fresh_pages", lambda run: checked.append(1) or region_maps)
    gm = torch.fx.symbolic_trace(lambda x: (x.relu() * 3,))
    region = types.SimpleNamespace(pass_name="a")
    m = site_gate.measure_region(region, [Recorded(torch.randn(4, 32), requires_grad=True)], True,
                                 clock=ControlledClock({"a": 0.5}), settings=QUICK, min_speedup=1.05,
                                 forms=(gm, gm), fresh_heap=fresh)
    return m, trims, checked


def test_a_region_mapping_fresh_pages_in_a_step_that_does_starts_each_sample_from_a_trimmed_heap(monkeypatch):
    m, trims, checked = _measure(monkeypatch, fresh=True, region_maps=True)
    assert checked == [1]
    assert len(trims) == len(m.baseline_times) + len(m.candidate_times) > 0  # one per timed sample


@pytest.mark.parametrize("fresh, region_maps", [(False, True), (True, False)])
def test_otherwise_the_samples_are_timed_as_they_run(monkeypatch, fresh, region_maps):
    m, trims, checked = _measure(monkeypatch, fresh=fresh, region_maps=region_maps)
    assert m.pairs > 0 and trims == [] and checked == ([1] if fresh else [])


def test_optimize_counts_the_steps_fresh_pages_once_and_keys_the_figures_by_it(monkeypatch, tmp_path):
    """The answer reaches every region comparison, is asked of the step once, and is in the
    knowledge-base key: figures timed on a kept heap are not replayed where the step maps
    fresh pages."""
    asked, seen = [], []
    monkeypatch.setattr(regions, "step_maps_fresh_pages", lambda run, tries: asked.append(tries) or True)
    real = regions.measure_region
    monkeypatch.setattr(regions, "measure_region", lambda *a, **k: seen.append(k["fresh_heap"]) or real(*a, **k))
    torch.manual_seed(0)
    model, x = Blocks(n=4).eval(), torch.randn(8, 16)
    kb = tmp_path / "kb.json"

    def run():
        return rewriter.optimize(model, (x,), passes=[RewriteRelu("a")], clock=ControlledClock({"a": 0.5}),
                                 gate=QUICK, profile=False, progress=False, knowledge_base=str(kb),
                                 compile=False)
    run()
    assert asked == [fresh_heap.STEP_TRIES] and seen and all(seen)
    monkeypatch.setattr(regions, "step_maps_fresh_pages", lambda run, tries: False)
    seen.clear()
    run()  # the heap as it runs: measured again, not replayed
    assert seen == [False] * len(seen) and seen

