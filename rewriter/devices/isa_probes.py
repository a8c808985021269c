"""Inductor's CPU vector-ISA test programs, built side by side at the start of a compile, and
loaded in one child Python.

Before its first CPU kernel, Inductor picks the vector instruction set by building and loading a
test program for each candidate the CPU's flags name (``torch._inductor.cpu_vec_isa.
valid_vec_isa_list``), one after another: on a 2-core Xeon without AMX, three candidates (AVX-512
with VNNI, AVX-512, AVX2) and their extra checks (AVX-512 BF16, VNNI) at ~1.5 s of g++ each,
~7 s of a cold first compile during which nothing else runs (the programs stay in Inductor's
cache folder: only a cold folder pays). Started in threads when a compile begins, the builds run
beside each other and beside Dynamo's and AOTAutograd's tracing, which comes first; Inductor's
own check then finds each program built (a build still running holds the program's file lock, so
Inductor waits for it and does not build it again). Cold cache, 2-core Xeon without AMX,
``optimize(compile=True)`` at 16 LLaMA layers: its first compiled step 19.6 / 16.6 / 19.1 /
18.4 s without, 16.3 / 16.1 / 15.4 / 15.9 s with (one process each, alternating; the README has
the command).

Inductor's check then loads each program in a Python of its own, one after another on the
compile's main thread (a ``dlopen`` of the program, and of libtorch for the base ones): ten
programs, 1.5 s of a cold BERT compile on the 2-core Xeon with AMX, and of every process's first
compile, warm cache or not (the answers last one process). Here, once the builds have ended,
one child Python loads them all, in the environment Inductor gives its own, each load on its
own (a failed ``dlopen`` is a False for that program alone); while a compile runs, Inductor's
load check of a program loaded there reads that answer, and any other program (or one a child
that died did not answer) is loaded Inductor's own way. BERT bf16 ``optimize(steps=20000)``,
alternating processes: cold, the compile 22.5 / 23.1 -> 21.5 / 21.4 s; a second process, its
Inductor cache warm, 3.87 / 3.79 -> 2.44 / 2.36 s.

The builds run on ISA objects of our own: the flags Inductor's check sets on its objects (the
AVX-512 BF16 check changes ``_arch_flags`` while it runs) and its cached answers are its own; the
threads see the caller's Inductor settings (``contextvars``: torch 2.13 keeps them per context).
A compile waits for the builds and the load before it returns (:func:`wait`), so none runs
during the timed steps that follow, and Inductor's load check is its own again::

    builds = start_vec_isa_probes()   # at the compile's start; returns at once
    ...                               # the compile
    wait(builds)                      # before anything is timed

Inductor's check builds every candidate's programs, then takes the first valid ISA (unless
``config.cpp.simdlen`` or ``ATEN_CPU_CAPABILITY`` asks for another): where it takes the first,
only the first candidate's programs are built here, and its list stops there, for the process
(:func:`check_up_to_the_first_valid`; the same ISA, so the same kernels).

Inductor's internals are private: anything unexpected leaves the builds and loads to Inductor
(no-op).
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import logging
import os
import platform
import subprocess
import sys
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
WAIT_SECONDS = 120.0  # a build that takes longer is left to finish on its own
LOAD_SECONDS = 60.0   # Inductor's own limit for one program's load

# While a compile runs: the programs built for it, the future of the child's load answers
# (path -> loaded), and Inductor's own load check, which ours stands in front of.
_BUILT: set[str] = set()
_LOADING: concurrent.futures.Future | None = None
_INDUCTORS_LOAD: Any = None
_LOCK = threading.Lock()
# Inductor's list of the valid ISAs, once ours stands in its place (for the process)
_INDUCTORS_LIST: Any = None

# What Inductor's child runs for one program (``VecISA._avx_py_load`` on Linux), once per path;
# one line per path, in order: a child that dies leaves the rest unanswered.
_LOAD_ALL = """
import sys
from ctypes import cdll
for path in sys.argv[1:]:
    try:
        cdll.LoadLibrary(path)
        print(1, flush=True)
    except OSError:
        print(0, flush=True)
"""


def candidate_isas() -> list[Any]:
    """The ISAs Inductor would check here, as ``valid_vec_isa_list`` selects them (x86 Linux)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    from torch._inductor import config, cpu_vec_isa
    if config.cpp.vec_isa_ok is not None or config.is_fbcode():
        return []  # Inductor does not build test programs then
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list
            if str(isa).split() and all(f in flags for f in str(isa).split())]


def picks_the_first() -> bool:
    """Whether Inductor picks the first valid ISA of its list (``pick_vec_isa``: no
    ``config.cpp.simdlen``, no ``ATEN_CPU_CAPABILITY``); the list's other entries then go unread."""
    from torch._inductor import config
    return config.cpp.simdlen is None and not os.environ.get("ATEN_CPU_CAPABILITY")


@functools.cache
def _up_to_the_first_valid() -> list[Any] | None:
    """The first valid candidate, alone (none valid: empty); None where there is no candidate
    of ours (off x86 Linux): Inductor's own list then."""
    isas = candidate_isas()
    if not isas:
        return None
    for isa in isas:
        if isa:  # Inductor's own check of it: its test programs built and loaded
            return [isa]
    return []


def _valid_vec_isa_list() -> list[Any]:
    """Inductor's ``valid_vec_isa_list``, checked only up to the first valid ISA where that is
    the one it picks (:func:`picks_the_first`); otherwise, or off x86 Linux, its own list."""
    first = _up_to_the_first_valid() if picks_the_first() else None
    return _INDUCTORS_LIST() if first is None else first


def _cache_clear() -> None:
    _up_to_the_first_valid.cache_clear()
    _INDUCTORS_LIST.cache_clear()


_valid_vec_isa_list.cache_info = _up_to_the_first_valid.cache_info  # type: ignore[attr-defined]
_valid_vec_isa_list.cache_clear = _cache_clear  # type: ignore[attr-defined]


def check_up_to_the_first_valid() -> None:
    """From now on in this process, Inductor's ISA check stops at the first valid ISA where
    that is the one it picks. Its own check builds and loads the test programs of every ISA the
    CPU's flags name, then takes the first: on the 2-core AMD EPYC three ISAs (AVX-512 with
    VNNI, AVX-512, AVX2), six programs, 5.8 s of g++ on both cores, of which a cold LLaMA
    compile's main thread waited ~4 s; the first ISA's three programs alone, ~2.7 s. The ISA
    picked, and so every kernel, is the same."""
    global _INDUCTORS_LIST
    from torch._inductor import cpu_vec_isa
    with _LOCK:
        if _INDUCTORS_LIST is None:
            _INDUCTORS_LIST = cpu_vec_isa.valid_vec_isa_list
            cpu_vec_isa.valid_vec_isa_list = _valid_vec_isa_list


def program_builds(isa: Any) -> list[tuple[Any, str]]:
    """(an ISA object of our own with the flags, the code) for each test program Inductor's
    check of ``isa`` builds (``cpu_vec_isa``: the base program with the ISA's flags, AVX-512's
    BF16 program with ``-mavx512bf16``, VNNI's, AMX's and its FP16 one), where the CPU has them."""
    from torch._inductor import cpu_vec_isa as v
    cls = type(isa)
    bf16 = isinstance(isa, v.VecAVX512) and bool(torch.cpu._is_avx512_bf16_supported())

    def ours(extra: str = "", after_bf16: bool = True) -> Any:
        mine = cls()
        mine._arch_flags = cls._arch_flags + extra
        # Inductor's check has found BF16 by the time it builds the later programs (AMX's
        # build flags carry -mavx512bf16 then)
        mine._is_avx512_bf16_supported = bf16 and after_bf16
        return mine
    builds = [(ours(after_bf16=False), v.VecISA._avx_code)]
    if bf16:
        builds.append((ours(" -mavx512bf16", after_bf16=False), v.VecAVX512._avx512_bf16_code))
    if isinstance(isa, v.VecAVX512VNNI) and torch.cpu._is_vnni_supported():
        builds.append((ours(), v.VecAVX512VNNI._avx512_vnni_code))
    if isinstance(isa, v.VecAMX):
        builds.append((ours(), v.VecAMX._amx_code))
        if torch.cpu._is_amx_fp16_supported():
            builds.append((ours(" -mamx-fp16"), v.VecAMX._amx_fp16_code))
    return builds


def start_vec_isa_probes() -> list[concurrent.futures.Future]:
    """Start building every test program Inductor's ISA check will want, each in a thread of
    its own (up to the CPU count), then loading them all in one child Python; returns the
    futures (the builds', then the load's) without waiting. A program already built (this
    process, or a warm cache folder) is found at once. Until :func:`wait`, Inductor's load
    check of a program loaded here reads the answer."""
    global _POOL, _LOADING
    try:
        if _inductor_has_decided():
            return []  # its answers last the process: no program is built or loaded again
        isas = candidate_isas()
        if picks_the_first():  # the first's programs: Inductor reads no further where it is valid
            check_up_to_the_first_valid()
            isas = isas[:1]
        # one build per program (path): see _answered_load
        builds = list({(mine.build_arch_flags(), code): (mine, code)
                       for isa in isas for mine, code in program_builds(isa)}.values())
    except Exception as e:  # torch's layout changed: Inductor builds them as it always did
        log.debug("rewriter: vector-ISA test builds not started: %s", e)
        return []
    if len(builds) < 2:
        return []
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                                      thread_name_prefix="rewriter-isa-probe")
    try:
        env = _probe_env()
    except Exception as e:  # torch's layout changed: Inductor loads them as it always did
        log.debug("rewriter: vector-ISA test programs left to Inductor to load: %s", e)
        env = None
    loading: concurrent.futures.Future | None = None if env is None else concurrent.futures.Future()
    with _LOCK:  # before the builds start: a program found built at once is recorded
        _BUILT.clear()
        _LOADING = loading
    futures = [_POOL.submit(contextvars.copy_context().run, _build, mine, code) for mine, code in builds]
    if loading is None:
        return futures
    # a thread of its own: a pool worker waiting for the builds would take a worker from them
    threading.Thread(target=_load_when_built, args=(futures, env, loading), daemon=True,
                     name="rewriter-isa-load").start()
    _stand_in_front_of_inductors_load()
    return futures + [loading]


def _inductor_has_decided() -> bool:
    """Whether Inductor has picked its ISAs in this process already (``valid_vec_isa_list`` is
    cached, its own or ours: a second compile checks nothing)."""
    from torch._inductor import cpu_vec_isa
    for listing in (cpu_vec_isa.valid_vec_isa_list, _INDUCTORS_LIST):
        info = getattr(listing, "cache_info", None)
        if info is not None and info().currsize > 0:
            return True
    return False


def _build(mine: Any, code: str) -> str | None:
    """Inductor's own build of one test program (``VecISA.check_build``, not cached), without
    its load (one child loads them all: :func:`load_in_one_child`), on our own object only.
    Returns the program's path, or None when it did not build."""
    built: list[str] = []
    mine._probe_load = lambda path: built.append(path) or True
    if not (mine.check_build(code) and built):
        return None
    with _LOCK:
        _BUILT.add(built[0])
    return built[0]


def load_in_one_child(paths: list[str], env: dict[str, str] | None = None,
                      timeout: float = LOAD_SECONDS) -> dict[str, bool]:
    """Whether each program loads (``dlopen``) in a fresh Python, one Python for them all; the
    answers given before the child ended (one that dies or hangs leaves the rest out)::

        load_in_one_child(["/cache/ab/cabc.so", "/nowhere.so"])  # {".../cabc.so": True, "/nowhere.so": False}
    """
    if not paths:
        return {}
    try:
        done = subprocess.run([sys.executable, "-c", _LOAD_ALL, *paths], env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        out = done.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
    except OSError:
        return {}
    return {path: line == b"1" for path, line in zip(paths, out.split())}


def _probe_env() -> dict[str, str]:
    """The environment Inductor's load check gives its child (libtorch on the loader's path);
    raises where Inductor has no such check to stand in front of (another torch)."""
    from torch._inductor import cpu_vec_isa
    if not callable(getattr(cpu_vec_isa.VecISA, "_probe_load", None)):
        raise AttributeError("torch._inductor.cpu_vec_isa.VecISA has no _probe_load")
    return cpu_vec_isa.VecISA._build_probe_env()


def _load_when_built(builds: list[concurrent.futures.Future], env: dict[str, str],
                     loading: concurrent.futures.Future) -> None:
    try:
        concurrent.futures.wait(builds, timeout=WAIT_SECONDS)
        paths = {f.result() for f in builds if f.done() and f.exception() is None} - {None}
        loading.set_result(load_in_one_child(sorted(paths), env))
    except Exception as e:  # noqa: BLE001 (Inductor loads them its own way then)
        loading.set_exception(e)


def _stand_in_front_of_inductors_load() -> None:
    global _INDUCTORS_LOAD
    from torch._inductor import cpu_vec_isa
    with _LOCK:
        if _INDUCTORS_LOAD is None:
            _INDUCTORS_LOAD = cpu_vec_isa.VecISA._probe_load
            cpu_vec_isa.VecISA._probe_load = _answered_load


def _answered_load(isa: Any, output_path: str) -> bool:
    """Inductor's load check of one program while a compile runs: the child's answer where it
    loaded that program (waiting for it while it loads), else Inductor's own check.

    Inductor checks a program holding its file lock; the child starts once every build here has
    ended, and a build of this program would wait for that lock. So the child is waited for
    only for a program built here already (one build per program: no other build of ours waits
    for this lock); any other is Inductor's to load, at once."""
    with _LOCK:
        loading, own, ours = _LOADING, _INDUCTORS_LOAD, output_path in _BUILT
    answer = None
    if loading is not None and ours:
        try:
            answer = loading.result(timeout=WAIT_SECONDS + LOAD_SECONDS).get(output_path)
        except Exception:  # noqa: BLE001 (no answer: Inductor's own check)
            pass
    if answer is not None:
        return answer
    if own is None:  # the compile has ended (wait): Inductor's own check is back in place
        from torch._inductor import cpu_vec_isa
        own = cpu_vec_isa.VecISA._probe_load
    return own(isa, output_path)


def wait(futures: list[concurrent.futures.Future], timeout: float = WAIT_SECONDS) -> None:
    """Until the builds and the load have ended (their outcome is Inductor's to read, not ours);
    Inductor's load check is its own again after."""
    global _LOADING, _INDUCTORS_LOAD
    if futures:
        concurrent.futures.wait(futures, timeout=timeout)
    with _LOCK:
        _LOADING = None
        _BUILT.clear()
        if _INDUCTORS_LOAD is not None:
            from torch._inductor import cpu_vec_isa
            cpu_vec_isa.VecISA._probe_load = _INDUCTORS_LOAD
            _INDUCTORS_LOAD = None


def _forget_pool() -> None:
    global _POOL, _LOCK, _LOADING
    # a forked child has none of the parent's threads: a pool, a lock and no load of its own
    _POOL, _LOCK, _LOADING = None, threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
