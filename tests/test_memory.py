"""Memory as an objective: peak measurement, the memory decision, the report's memory view.

Decisions are made with a controlled clock that also injects each variant's peak bytes
(tests/controlled.py), never with wall-clock or measured memory thresholds.
"""
import pytest
import torch

import rewriter
from rewriter.decide.gate import Measurement
from rewriter.decide.memory import (
    MemoryTimeline,
    decide_memory,
    memory_timeline,
    peak_bytes,
    peak_from_events,
)
from rewriter.devices.backends import CpuBackend
from tests.controlled import QUICK, ControlledClock, StepRelu
from tests.models import ReluMLP


def _opt(model, x, clock, **kw):
    return rewriter.optimize(model, (x,), passes=[StepRelu("m")], clock=clock, gate=QUICK,
                             profile=False, progress=False, knowledge_base=False,
                             time_budget=None, **kw)


def _decision(fast):
    return next(d for d in fast.report.decisions if d.pass_name == "m")


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return ReluMLP(), torch.randn(8, 16)


def test_memory_objective_keeps_a_rewrite_that_saves_memory_at_equal_time(mlp):
    model, x = mlp
    fast = _opt(model.eval(), x, ControlledClock(peaks={"m": 0.5}), objective="memory")
    d = _decision(fast)
    assert d.kept and d.objective == "memory"
    assert d.peak_mb_before == pytest.approx(100.0) and d.peak_mb_after == pytest.approx(50.0)
    assert "saves memory" in d.reason and "-50%" in d.reason
    assert fast.report.final["kept"]  # the step check accepts a within-bound slowdown
    md = fast.report.to_markdown()
    assert "## Memory (objective: memory)" in md and "| m | memory | 100.00 -> 50.00 |" in md


def test_memory_objective_rejects_a_rewrite_ten_percent_slower(mlp):
    model, x = mlp
    fast = _opt(model.eval(), x, ControlledClock({"m": 1.10}, peaks={"m": 0.5}), objective="memory")
    d = _decision(fast)
    assert not d.kept and d.objective == "memory"
    assert "too slow for the memory objective" in d.reason and "3% slowdown bound" in d.reason


def test_a_wider_slowdown_bound_keeps_the_slower_rewrite(mlp):
    model, x = mlp
    fast = _opt(model.eval(), x, ControlledClock({"m": 1.10}, peaks={"m": 0.5}), objective="memory",
                memory_slowdown=0.2)
    assert _decision(fast).kept


def test_time_objective_ignores_the_memory_saving_but_reports_it(mlp):
    model, x = mlp
    fast = _opt(model.eval(), x, ControlledClock(peaks={"m": 0.5}))
    d = _decision(fast)
    assert not d.kept and d.objective == "time"
    assert d.peak_mb_before == pytest.approx(100.0) and d.peak_mb_after == pytest.approx(50.0)


def test_memory_objective_rejects_a_faster_rewrite_that_raises_the_peak(mlp):
    model, x = mlp
    fast = _opt(model.eval(), x, ControlledClock({"m": 0.5}, peaks={"m": 1.5}), objective="memory")
    d = _decision(fast)
    assert not d.kept and "raises peak memory" in d.reason
    kept = _opt(model.eval(), x, ControlledClock({"m": 0.5}, peaks={"m": 1.0}), objective="memory")
    assert _decision(kept).kept and _decision(kept).objective == "time"


def test_memory_objective_in_the_plan_fingerprint(mlp):
    model, x = mlp
    fast = _opt(model.eval(), x, ControlledClock(peaks={"m": 0.5}), objective="memory")
    assert fast.report.plan["fingerprint"]["objective"] == "memory"
    timed = _opt(model.eval(), x, ControlledClock(peaks={"m": 0.5}))
    assert "objective" not in timed.report.plan["fingerprint"]


@pytest.mark.parametrize("bad", [dict(objective="speed"), dict(objective=None),
                                 dict(memory_slowdown=-0.1), dict(memory_slowdown=1.0),
                                 dict(memory_slowdown="3%"), dict(memory_slowdown=True)])
def test_bad_objective_settings_are_clear_errors(mlp, bad):
    model, x = mlp
    with pytest.raises(ValueError, match="objective|memory_slowdown"):
        rewriter.optimize(model, (x,), profile=False, progress=False, **bad)


def _measured(speedup: float) -> Measurement:
    return Measurement(baseline_times=[speedup] * 4, candidate_times=[1.0] * 4)


def test_decide_memory_rules():
    mb = 2**20
    assert decide_memory(_measured(1.0), 100 * mb, 40 * mb, 0.03)[0]
    assert decide_memory(_measured(0.975), 100 * mb, 40 * mb, 0.03)[0]  # 2.6% slower: within
    keep, why = decide_memory(_measured(0.95), 100 * mb, 40 * mb, 0.03)
    assert not keep and "too slow" in why
    keep, why = decide_memory(_measured(1.0), 100 * mb, 99.5 * mb, 0.03)
    assert not keep and "saves no memory" in why  # under 1% is allocator noise
    assert not decide_memory(_measured(1.0), None, 40 * mb, 0.03)[0]


def test_peak_from_events_is_the_running_maximum():
    # out of order on purpose: summed in time order
    assert peak_from_events([(3, -50), (1, 100), (2, 30), (4, 10)]) == 130
    assert peak_from_events([]) == 0


def test_cpu_peak_counts_what_a_step_allocates_above_its_start():
    keep = torch.zeros(1 << 20)  # live before: not counted

    def step():
        a = torch.ones(1 << 20)           # 4 MB
        b = torch.ones(1 << 19)           # 2 MB, both live: 6 MB peak
        del a, b
        torch.ones(1 << 18)               # 1 MB after the frees

    peak = peak_bytes(step, CpuBackend())
    assert peak == pytest.approx(6 * 2**20, rel=0.01)
    assert keep.numel()


def test_memory_timeline_finds_the_peak_and_the_allocators():
    def step():
        a = torch.ones(1 << 20)
        b = a * 2                           # the peak: a and b live
        del a
        return b.sum()

    t = memory_timeline(step, CpuBackend())
    assert t is not None and t.peak_bytes == pytest.approx(8 * 2**20, rel=0.01)
    assert t.peak_op in ("aten::mul", "aten::empty_strided", "aten::empty")
    assert any(op in ("aten::ones", "aten::empty", "aten::mul") for op, _, _ in t.top_allocators)
    assert 0 <= t.peak_ms <= t.step_ms
    line = t.sparkline(20)
    assert len(line) == 20 and "█" in line
    assert "peak 8.00 MB" in t.to_markdown()
    again = MemoryTimeline(**{**t.__dict__})
    assert again.to_dict() == t.to_dict()


def test_report_memory_view_before_and_after(mlp, tmp_path):
    model, x = mlp
    fast = rewriter.optimize(model.eval(), (x,), passes=[StepRelu("m")],
                             clock=ControlledClock(peaks={"m": 0.5}), gate=QUICK, profile=True,
                             progress=False, knowledge_base=False, time_budget=None,
                             objective="memory")
    view = fast.report.memory
    assert set(view) == {"before", "after"} and view["before"]["peak_mb"] > 0
    md = fast.report.to_markdown()
    assert "### Memory over the step, before" in md and "### Memory over the step, after" in md
    fast.report.save(tmp_path)
    import json
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["objective"] == "memory" and saved["memory"]["after"]["samples"]


class FakeAllocator:
    """torch.cuda / torch.npu's allocator statistics, as a device with 10 MB live before the step."""

    def __init__(self):
        self.live, self.peak = 10 * 2**20, 10 * 2**20

    def memory_allocated(self):
        return self.live

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.live

    def allocate(self, nbytes):
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def test_device_peak_reads_the_allocator_statistics(monkeypatch):
    from rewriter.decide import memory
    fake = FakeAllocator()
    monkeypatch.setattr(memory, "_allocator", lambda device_type: fake)

    class Npu:
        device_type = "npu"
        synced = 0

        def synchronize(self):
            self.synced += 1

    def step():
        fake.allocate(6 * 2**20)
        fake.allocate(-4 * 2**20)

    backend = Npu()
    assert peak_bytes(step, backend) == 6 * 2**20  # above the 10 MB live at the start
    assert backend.synced == 2


def test_a_device_without_statistics_tells_nothing(monkeypatch):
    from rewriter.decide import memory
    monkeypatch.setattr(memory, "_allocator", lambda device_type: None)

    class Npu:
        device_type = "npu"

        def synchronize(self):
            pass

    assert peak_bytes(lambda: None, Npu()) is None
