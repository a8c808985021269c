"""Inductor's CPU vector-ISA probes, run side by side at the start of a compile.

Before its first CPU kernel, Inductor picks the vector instruction set by building and loading a
test program for each candidate the CPU's flags name (``torch._inductor.cpu_vec_isa.
valid_vec_isa_list``), one after another: on a 2-core Xeon without AMX, three candidates (AVX-512
with VNNI, AVX-512, AVX2) at ~1.9 s each, 7 s of a cold first compile during which nothing else
runs (the built programs stay in Inductor's cache folder: only a cold folder pays). Started in
threads when a compile begins, they build beside each other and beside Dynamo's and
AOTAutograd's tracing, which runs first; Inductor's own check then finds each result cached (a
check still running holds the program's file lock, so Inductor waits for it and does not build it
again). Cold cache, 2-core Xeon without AMX: one LLaMA decoder layer (hidden 512) compiled,
forward and backward, 19.0 s -> 12.8 s; ``optimize(compile=True)`` at 16 LLaMA layers, its first
compiled step 17.7 / 17.6 s -> 15.1 / 14.9 s (runs alternating, one process each)::

    probes = start_vec_isa_probes()   # at the compile's start; returns at once

Inductor's internals are private: anything unexpected leaves the probes to Inductor (no-op).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import platform
import sys
from typing import Any

log = logging.getLogger(__name__)

_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def candidate_isas() -> list[Any]:
    """The ISAs Inductor would probe here, as ``valid_vec_isa_list`` selects them (x86 Linux)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    from torch._inductor import config, cpu_vec_isa
    if config.cpp.vec_isa_ok is not None or config.is_fbcode():
        return []  # Inductor does not build test programs then
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list
            if str(isa).split() and all(f in flags for f in str(isa).split())]


def start_vec_isa_probes() -> list[concurrent.futures.Future]:
    """Start each candidate ISA's probe in a thread of its own (up to the CPU count); returns
    their futures without waiting. Harmless when the results are cached (in this process or on
    disk): a cached probe returns at once."""
    global _POOL
    try:
        isas = candidate_isas()
    except Exception as e:  # torch's layout changed: Inductor probes as it always did
        log.debug("rewriter: vector-ISA probes not started: %s", e)
        return []
    if len(isas) < 2:
        return []
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                                      thread_name_prefix="rewriter-isa-probe")
    return [_POOL.submit(_probe, isa) for isa in isas]


def _probe(isa: Any) -> bool:
    """Inductor's own check (it caches the answer). A probe that failed, say because a cache
    folder went away under it, would leave Inductor believing the ISA absent for the rest of the
    process, and picking a slower one: a False is forgotten, so Inductor checks again itself."""
    ok = bool(isa)
    if not ok:
        forget_probes(isa)
    return ok


def forget_probes(isa: Any) -> None:
    """Clear the cached answers of ``isa``'s class (functools caches on its methods)."""
    for cls in type(isa).__mro__:
        for attr in vars(cls).values():
            clear = getattr(attr, "cache_clear", None)
            if callable(clear):
                clear()
