"""Inductor's vector-ISA test programs are built side by side, off the main thread, at a
compile's start, on objects of our own, loaded in one child Python whose answers Inductor's
check reads while the compile runs, and ended before anything is timed."""
import concurrent.futures
import ctypes.util
import threading

import pytest
import torch
import torch.nn as nn

from rewriter.devices import isa_probes


@pytest.fixture(autouse=True)
def _inductor_has_not_decided(monkeypatch):
    """As in a process's first compile (an earlier test's compile has Inductor's answers cached)."""
    monkeypatch.setattr(isa_probes, "_inductor_has_decided", lambda: False)


class _Build:
    """A stand-in test program whose build waits until every other one has started: it passes
    only if the builds run at the same time."""

    def __init__(self, barrier: threading.Barrier, seen: list, name: str) -> None:
        self.barrier, self.seen, self.name = barrier, seen, name

    def build_arch_flags(self) -> str:
        return self.name

    def check_build(self, code: str) -> bool:
        self.seen.append(threading.current_thread() is threading.main_thread())
        self.barrier.wait(timeout=10)  # raises BrokenBarrierError if they ran one after another
        return self._probe_load(f"/nowhere/{self.name}.so")


def test_builds_run_side_by_side_off_the_main_thread_and_the_start_does_not_wait(monkeypatch):
    barrier, seen = threading.Barrier(3), []
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["x"])  # one ISA, two programs
    monkeypatch.setattr(isa_probes, "program_builds", lambda isa: [(_Build(barrier, seen, n), "code") for n in "ab"])
    futures = isa_probes.start_vec_isa_probes()
    assert len(futures) == 3 and not any(f.done() for f in futures)  # nobody waited for them
    barrier.wait(timeout=10)  # the third party: this test, while both builds are running
    isa_probes.wait(futures)
    assert sorted(f.result() for f in futures[:2]) == ["/nowhere/a.so", "/nowhere/b.so"]
    assert seen == [False, False]
    # then one child loaded both (neither exists)
    assert futures[2].result() == {"/nowhere/a.so": False, "/nowhere/b.so": False}


def _two_programs(isa):
    """One ISA's two test programs, as AVX-512's base and BF16 ones."""
    return [(_Program(), "a"), (_Program(), "b")]


class _Program:
    """Stands in for an ISA object: builds, then loads as Inductor's ``check_build`` does."""
    loaded: list = []

    def build_arch_flags(self) -> str:
        return ""

    def _probe_load(self, output_path: str) -> bool:
        self.loaded.append(output_path)
        return True

    def check_build(self, code: str) -> bool:
        return self._probe_load(f"/cache/{code}.so")


def test_a_build_here_does_not_load_what_it_builds_inductors_own_objects_still_check():
    """The loads are one child's, after the builds: a build returns its program's path."""
    mine, theirs = _Program(), _Program()
    _Program.loaded = []
    assert isa_probes._build(mine, "avx512") == "/cache/avx512.so"
    assert _Program.loaded == []
    assert theirs.check_build("avx512") and _Program.loaded == ["/cache/avx512.so"]


def test_one_child_answers_for_each_program_on_its_own():
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library to load")
    assert isa_probes.load_in_one_child([libc, "/nowhere/a.so", libc]) == {libc: True, "/nowhere/a.so": False}
    assert isa_probes.load_in_one_child([]) == {}


def test_while_a_compile_runs_inductors_load_check_reads_the_childs_answer(monkeypatch):
    """A program the child loaded: its answer, no load of Inductor's (False here, where a real
    load would say True: the answer is the child's); any other program: Inductor's own check.
    After the compile, Inductor's check is its own again."""
    from torch._inductor import cpu_vec_isa as v
    own_loads = []

    def inductors_load(self, path):
        own_loads.append(path)
        return True
    monkeypatch.setattr(v.VecISA, "_probe_load", inductors_load)
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["x"])
    monkeypatch.setattr(isa_probes, "program_builds", _two_programs)
    monkeypatch.setattr(isa_probes, "load_in_one_child",
                        lambda paths, env=None: {p: False for p in paths})
    futures = isa_probes.start_vec_isa_probes()
    try:
        concurrent.futures.wait(futures[:-1], timeout=10)  # as Dynamo's tracing comes first
        isa = v.VecAVX2()
        assert isa._probe_load("/cache/a.so") is False and isa._probe_load("/cache/b.so") is False
        assert own_loads == []
        assert isa._probe_load("/cache/other.so") is True and own_loads == ["/cache/other.so"]
    finally:
        isa_probes.wait(futures)
    assert v.VecISA._probe_load is inductors_load


def test_an_inductor_without_the_load_check_loads_the_programs_its_own_way(monkeypatch):
    """Another torch's layout: the builds still run, nothing stands in front of Inductor."""
    from torch._inductor import cpu_vec_isa as v
    monkeypatch.delattr(v.VecISA, "_probe_load")
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["x"])
    monkeypatch.setattr(isa_probes, "program_builds", _two_programs)
    futures = isa_probes.start_vec_isa_probes()
    isa_probes.wait(futures)
    assert sorted(f.result() for f in futures) == ["/cache/a.so", "/cache/b.so"]
    assert not hasattr(v.VecISA, "_probe_load")


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


def test_a_program_inductor_checks_before_its_build_here_ended_is_inductors_to_load(monkeypatch):
    """Inductor checks a program holding its file lock, which our build of it waits for; the
    child starts once every build here has ended: waiting for the child there would wait for
    ever (until the timeout). Inductor loads that program itself, at once."""
    from torch._inductor import cpu_vec_isa as v
    file_lock, own_loads = threading.Lock(), []
    monkeypatch.setattr(v.VecISA, "_probe_load", lambda self, path: own_loads.append(path) or True)

    class _Locked(_Program):
        def check_build(self, code: str) -> bool:
            with file_lock:  # as Inductor's FileLock of this program
                return self._probe_load(f"/cache/{code}.so")
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["x"])
    monkeypatch.setattr(isa_probes, "program_builds", lambda isa: [(_Locked(), code) for code in "ab"])
    with file_lock:  # Inductor's check of program "a", under its lock
        futures = isa_probes.start_vec_isa_probes()
        assert v.VecAVX2()._probe_load("/cache/a.so") is True
        assert own_loads == ["/cache/a.so"] and not futures[-1].done()
    isa_probes.wait(futures)
    assert futures[-1].done()


def _clear_inductors_answers():
    """Inductor works the real answers out again when next asked."""
    from torch._inductor import cpu_vec_isa as v
    for cls in (v.VecISA, v.VecAVX2, v.VecAVX512, v.VecAVX512VNNI, v.VecAMX):
        for attr in vars(cls).values():
            if callable(getattr(attr, "cache_clear", None)):
                attr.cache_clear()


def test_inductors_check_decides_the_same_with_the_childs_answers_as_with_its_own_loads(monkeypatch):
    """The real check, twice on fresh ISA objects: once our builds have ended, with one child's
    loads in front of it (none of its own loads runs), then on its own (it loads every program)."""
    import platform

    from torch._inductor import cpu_vec_isa as v
    checked = isa_probes.candidate_isas()[:1] if isa_probes.picks_the_first() else isa_probes.candidate_isas()
    if platform.machine() != "x86_64" or len([b for isa in checked for b in isa_probes.program_builds(isa)]) < 2:
        pytest.skip("x86 with two or more test programs only")
    own_loads = []
    inductors = v.VecISA._probe_load
    monkeypatch.setattr(v.VecISA, "_probe_load", lambda self, path: own_loads.append(path) or inductors(self, path))

    def decide():
        _clear_inductors_answers()
        try:
            return [(bool(isa), isa.build_arch_flags()) for isa in (type(c)() for c in checked)]
        finally:
            _clear_inductors_answers()
    futures = isa_probes.start_vec_isa_probes()
    try:
        concurrent.futures.wait(futures[:-1], timeout=120)  # as Dynamo's tracing comes first
        answered = decide()
    finally:
        isa_probes.wait(futures)
    assert own_loads == [] and futures[-1].result(), "Inductor loaded a program itself"
    assert decide() == answered and own_loads, "Inductor decided otherwise on its own loads"
    assert any(ok for ok, _ in answered)


def test_once_inductor_has_picked_its_isas_a_later_compile_builds_and_loads_nothing(monkeypatch):
    """Inductor's answers last the process: a second compile's builds were found at once, and a
    child would load them again for nothing."""
    from torch._inductor import cpu_vec_isa as v
    monkeypatch.undo()  # the real question, not the fixture's answer
    v.valid_vec_isa_list()  # Inductor picks (its builds are on disk from the tests above, or built now)
    assert isa_probes._inductor_has_decided()
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["x"])
    monkeypatch.setattr(isa_probes, "program_builds", _two_programs)
    assert isa_probes.start_vec_isa_probes() == []
    v.valid_vec_isa_list.cache_clear()  # (Inductor picks again when next asked)
    assert not isa_probes._inductor_has_decided()
    futures = isa_probes.start_vec_isa_probes()
    isa_probes.wait(futures)
    assert len(futures) == 3


class _Isa:
    """Stands in for one of Inductor's ISA objects: its check (``bool``) says ``ok``."""

    def __init__(self, name: str, ok: bool, checked: list) -> None:
        self.name, self.ok, self.checked = name, ok, checked

    def __bool__(self) -> bool:
        self.checked.append(self.name)
        return self.ok


@pytest.fixture
def inductors_list(monkeypatch):
    """Inductor's list of valid ISAs over three stand-ins (the first fails its check), with ours
    in its place as a compile leaves it; the real list again after the test."""
    from torch._inductor import cpu_vec_isa as v
    checked: list = []
    isas = [_Isa("amx", False, checked), _Isa("avx512", True, checked), _Isa("avx2", True, checked)]

    def inductors():
        return [isa for isa in isas if isa]
    inductors.cache_clear = lambda: None
    monkeypatch.setattr(v, "valid_vec_isa_list", inductors)
    monkeypatch.setattr(isa_probes, "_INDUCTORS_LIST", None)
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: isas)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    isa_probes._up_to_the_first_valid.cache_clear()
    isa_probes.check_up_to_the_first_valid()
    yield v, isas, checked
    isa_probes._up_to_the_first_valid.cache_clear()


def test_inductors_isa_check_stops_at_the_first_valid_isa_the_one_it_picks(inductors_list):
    v, isas, checked = inductors_list
    assert v.valid_vec_isa_list() == [isas[1]] and checked == ["amx", "avx512"]
    assert v.valid_vec_isa_list() == [isas[1]] and checked == ["amx", "avx512"]  # asked once


@pytest.mark.parametrize("ask", ["simdlen", "ATEN_CPU_CAPABILITY"])
def test_where_inductor_picks_by_width_or_by_name_it_checks_them_all(inductors_list, monkeypatch, ask):
    from torch._inductor import config
    v, isas, checked = inductors_list
    if ask == "simdlen":
        monkeypatch.setattr(config.cpp, "simdlen", 256)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert v.valid_vec_isa_list() == isas[1:] and checked == ["amx", "avx512", "avx2"]


@pytest.mark.parametrize("picks_the_first, built", [(True, ["/cache/first1.so", "/cache/first2.so"]),
                                                     (False, ["/cache/first1.so", "/cache/first2.so",
                                                              "/cache/second1.so", "/cache/second2.so"])])
def test_only_the_first_candidates_programs_are_built_where_inductor_picks_it(monkeypatch, picks_the_first, built):
    monkeypatch.setattr(isa_probes, "picks_the_first", lambda: picks_the_first)
    monkeypatch.setattr(isa_probes, "check_up_to_the_first_valid", lambda: None)
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: ["first", "second"])
    monkeypatch.setattr(isa_probes, "program_builds", lambda isa: [(_Program(), isa + "1"), (_Program(), isa + "2")])
    monkeypatch.setattr(isa_probes, "load_in_one_child", lambda paths, env=None: {p: True for p in paths})
    futures = isa_probes.start_vec_isa_probes()
    isa_probes.wait(futures)
    assert sorted(f.result() for f in futures[:-1]) == built


def test_without_candidates_of_ours_inductors_own_list_answers(inductors_list, monkeypatch):
    v, isas, checked = inductors_list  # off x86 Linux, or with config.cpp.vec_isa_ok set
    monkeypatch.setattr(isa_probes, "candidate_isas", lambda: [])
    assert v.valid_vec_isa_list() == isas[1:] and checked == ["amx", "avx512", "avx2"]
