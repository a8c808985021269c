"""Inductor's vector-ISA probes start side by side, off the main thread, at a compile's start."""
import threading

import pytest
import torch
import torch.nn as nn

from rewriter.devices import isa_probes


class _Probe:
    """A stand-in ISA whose probe waits until every other one has started: it passes only if
    the probes run at the same time."""

    def __init__(self, barrier: threading.Barrier, seen: list) -> None:
        self.barrier, self.seen = barrier, seen

    def __bool__(self) -> bool:
        self.seen.append(threading.current_thread() is threading.main_thread())
        self.barrier.wait(timeout=10)  # raises BrokenBarrierError if they ran one after another
        return True


def test_probes_run_side_by_side_off_the_main_thread_and_the_call_does_not_wait(monkeypatch):
    barrier, seen = threading.Barrier(3), []
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: [_Probe(barrier, seen) for _ in range(2)])
    futures = isa_probes.start_vec_isa_probes()
    assert len(futures) == 2 and not any(f.done() for f in futures)  # nobody waited for them
    barrier.wait(timeout=10)  # the third party: this test, while both probes are running
    assert [f.result(timeout=10) for f in futures] == [True, True] and seen == [False, False]


def test_a_failed_probe_is_forgotten_so_inductor_checks_again_and_a_passed_one_is_kept():
    """Inductor caches each ISA's answer; a probe that failed in our thread (a cache folder
    removed under it, say) must not leave it believing the ISA absent (a slower one picked)."""
    import functools
    asked = []

    class Isa:
        def __init__(self, ok):
            self.ok = ok

        @functools.cache  # noqa: B019  (as Inductor's VecISA caches it)
        def answer(self):
            asked.append(self.ok)
            return self.ok

        def __bool__(self):
            return self.answer()
    good, bad = Isa(True), Isa(False)
    assert isa_probes._probe(good) is True and isa_probes._probe(bad) is False
    assert Isa.answer.cache_info().currsize == 0  # forgotten (the class's cache, both entries)
    bool(bad)
    assert asked == [True, False, False]  # asked again
    assert isa_probes._probe(good) is True and bool(good) and asked == [True, False, False, True]


def test_an_unexpected_inductor_layout_leaves_the_probes_to_inductor(monkeypatch):
    def broken():
        raise AttributeError("torch._inductor.cpu_vec_isa has no x86_isa_checker")
    monkeypatch.setattr(isa_probes, "candidate_isas", broken)
    assert isa_probes.start_vec_isa_probes() == []
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: [True])  # one: nothing to overlap
    assert isa_probes.start_vec_isa_probes() == []


def test_every_isa_inductor_keeps_here_is_among_the_candidates():
    """Inductor keeps the candidates whose test program builds and loads (``valid_vec_isa_list``,
    which any CPU compile calls anyway): each of them was probed in advance."""
    import platform

    from torch._inductor import cpu_vec_isa
    if platform.machine() != "x86_64":
        pytest.skip("x86 only")
    candidates = [str(i) for i in isa_probes.candidate_isas()]
    valid = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]
    assert valid and set(valid) <= set(candidates), (valid, candidates)


def test_an_inductor_compile_on_cpu_starts_them(monkeypatch):
    import rewriter
    import rewriter.decide.compile_gate as gate
    from tests.controlled import QUICK, ControlledClock
    started = []
    monkeypatch.setattr(gate, "start_vec_isa_probes", lambda: started.append(1) or [])
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval(), torch.randn(4, 8)
    fast = rewriter.optimize(model, (x,), clock=ControlledClock({"compile": 0.5}), gate=QUICK,
                             compile=True, passes=[], progress=False, profile=False,
                             knowledge_base=False)
    assert "compile" in fast.report.kept_passes and started
