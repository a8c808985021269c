"""Inductor's CPU vector-ISA test programs, built side by side at the start of a compile.

Before its first CPU kernel, Inductor picks the vector instruction set by building and loading a
test program for each candidate the CPU's flags name (``torch._inductor.cpu_vec_isa.
valid_vec_isa_list``), one after another: on a 2-core Xeon without AMX, three candidates (AVX-512
with VNNI, AVX-512, AVX2) and their extra checks (AVX-512 BF16, VNNI) at ~1.5 s of g++ each,
~7 s of a cold first compile during which nothing else runs (the programs stay in Inductor's
cache folder: only a cold folder pays). Started in threads when a compile begins, the builds run
beside each other and beside Dynamo's and AOTAutograd's tracing, which comes first; Inductor's
own check then finds each program built (a build still running holds the program's file lock, so
Inductor waits for it and does not build it again) and only loads it (the load is Inductor's
alone: the builds here do not load what they build).

Only the builds run here, on instances of our own: Inductor's check, its cached answers and the
flags it sets on its ISA objects (the AVX-512 BF16 check changes ``_arch_flags`` while it runs)
are its own, so nothing here can race it or change what it decides. The threads see the
caller's Inductor settings (``contextvars``: torch 2.13 keeps them per context). A compile waits
for them before it returns (:func:`wait`), so no build runs during the timed steps that follow.
Cold cache, 2-core Xeon without AMX, ``optimize(compile=True)`` at 16 LLaMA layers: its first
compiled step 19.6 / 16.6 / 19.1 / 18.4 s without, 16.3 / 16.1 / 15.4 / 15.9 s with (one process
each, alternating; the README has the command)::

    builds = start_vec_isa_probes()   # at the compile's start; returns at once
    ...                               # the compile
    wait(builds)                      # before anything is timed

Inductor's internals are private: anything unexpected leaves the builds to Inductor (no-op).
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import os
import platform
import sys
from typing import Any

import torch

log = logging.getLogger(__name__)

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
WAIT_SECONDS = 120.0  # a build that takes longer is left to finish on its own


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
    its own (up to the CPU count); returns their futures without waiting. A program already
    built (this process, or a warm cache folder) is found at once."""
    global _POOL
    try:
        builds = [b for isa in candidate_isas() for b in program_builds(isa)]
    except Exception as e:  # torch's layout changed: Inductor builds them as it always did
        log.debug("rewriter: vector-ISA test builds not started: %s", e)
        return []
    if len(builds) < 2:
        return []
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                                      thread_name_prefix="rewriter-isa-probe")
    return [_POOL.submit(contextvars.copy_context().run, _build, mine, code) for mine, code in builds]


def _build(mine: Any, code: str) -> bool:
    """Inductor's own build of one test program (``VecISA.check_build``, not cached), without
    its load: Inductor's check loads every program itself (a Python started to ``dlopen`` it,
    ~0.17 s of CPU each), so a second load here only took CPU from the compile beside it (cold
    BERT, 2-core Xeon with AMX, ten programs: the compile 22.6 -> 22.1 s, two alternating pairs of
    processes). On our own object only: Inductor's objects still load what they build."""
    mine._probe_load = _built
    return bool(mine.check_build(code))


def _built(output_path: str) -> bool:
    """What the load check answers for a program built here: Inductor's own check loads it."""
    return True


def wait(futures: list[concurrent.futures.Future], timeout: float = WAIT_SECONDS) -> None:
    """Until the builds have ended (their outcome is Inductor's to read, not ours)."""
    if futures:
        concurrent.futures.wait(futures, timeout=timeout)


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the parent's threads: a pool of its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
