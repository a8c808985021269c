"""Inductor's vector-ISA test programs are built side by side, off the main thread, at a
compile's start, on objects of our own, and ended before anything is timed."""
import threading

import pytest
import torch
import torch.nn as nn

from rewriter.devices import isa_probes


class _Build:
    """A stand-in test program whose build waits until every other one has started: it passes
    only if the builds run at the same time."""

    def __init__(self, barrier: threading.Barrier, seen: list) -> None:
        self.barrier, self.seen = barrier, seen

    def check_build(self, code: str) -> bool:
        self.seen.append(threading.current_thread() is threading.main_thread())
        self.barrier.wait(timeout=10)  # raises BrokenBarrierError if they ran one after another
        return True


def test_builds_run_side_by_side_off_the_main_thread_and_the_start_does_not_wait(monkeypatch):
    barrier, seen = threading.Barrier(3), []
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["a", "b"])
    monkeypatch.setattr(isa_probes, "program_builds", lambda isa: [(_Build(barrier, seen), "code")])
    futures = isa_probes.start_vec_isa_probes()
    assert len(futures) == 2 and not any(f.done() for f in futures)  # nobody waited for them
    barrier.wait(timeout=10)  # the third party: this test, while both builds are running
    isa_probes.wait(futures)
    assert [f.result() for f in futures] == [True, True] and seen == [False, False]


class _Program:
    """Stands in for an ISA object: builds, then loads as Inductor's ``check_build`` does."""
    loaded: list = []

    def _probe_load(self, output_path: str) -> bool:
        self.loaded.append(output_path)
        return True

    def check_build(self, code: str) -> bool:
        return self._probe_load(f"/cache/{code}.so")


def test_the_builds_here_do_not_load_what_they_build_inductors_own_objects_still_do():
    """Inductor's check loads each program itself: a load here too only took CPU from the compile."""
    mine, theirs = _Program(), _Program()
    _Program.loaded = []
    assert isa_probes._build(mine, "avx512") is True
    assert _Program.loaded == []
    assert theirs.check_build("avx512") and _Program.loaded == ["/cache/avx512.so"]


def test_an_unexpected_inductor_layout_leaves_the_builds_to_inductor(monkeypatch):
    def broken():
        raise AttributeError("torch._inductor.cpu_vec_isa has no x86_isa_checker")
    monkeypatch.setattr(isa_probes, "candidate_isas", broken)
    assert isa_probes.start_vec_isa_probes() == []
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["a"])
    monkeypatch.setattr(isa_probes, "program_builds", lambda isa: [(None, "code")])  # one: nothing to overlap
    assert isa_probes.start_vec_isa_probes() == []


def test_the_builds_are_the_ones_inductors_own_check_makes_on_objects_of_our_own(monkeypatch):
    """Inductor's check of fresh ISA objects, its builds recorded instead of run, asks for the
    same (build flags, program) pairs as ours; ours are never Inductor's own objects (whose
    flags its check changes while it runs)."""
    import platform

    from torch._inductor import cpu_vec_isa as v
    if platform.machine() != "x86_64":
        pytest.skip("x86 only")
    candidates = isa_probes.candidate_isas()
    assert candidates, "no x86 ISA candidate on an x86-64 machine"

    def clear_answers():  # (Inductor works the real answers out again when next asked)
        for cls in (v.VecISA, v.VecAVX2, v.VecAVX512, v.VecAVX512VNNI, v.VecAMX):
            for attr in vars(cls).values():
                if callable(getattr(attr, "cache_clear", None)):
                    attr.cache_clear()
    built = []
    monkeypatch.setattr(v.VecISA, "check_build",
                        lambda self, code: built.append((self.build_arch_flags(), code)) or True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: True)
    clear_answers()
    try:
        for isa in candidates:
            bool(type(isa)())
    finally:
        clear_answers()
    ours = [(mine, code) for isa in candidates for mine, code in isa_probes.program_builds(isa)]
    assert {(mine.build_arch_flags(), code) for mine, code in ours} == set(built)
    assert not any(mine is isa for mine, _ in ours for isa in v.supported_vec_isa_list)


def test_an_inductor_compile_on_cpu_starts_them_and_waits_for_them(monkeypatch):
    import rewriter
    import rewriter.decide.compile_gate as gate
    from tests.controlled import QUICK, ControlledClock
    events = []
    monkeypatch.setattr(gate, "start_vec_isa_probes", lambda: events.append("start") or ["f"])
    monkeypatch.setattr(gate, "wait_for_isa_probes", lambda builds: events.append(("wait", builds)))
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval(), torch.randn(4, 8)
    fast = rewriter.optimize(model, (x,), clock=ControlledClock({"compile": 0.5}), gate=QUICK,
                             compile=True, passes=[], progress=False, profile=False,
                             knowledge_base=False)
    assert "compile" in fast.report.kept_passes
    assert events[:2] == ["start", ("wait", ["f"])]
