"""Which CPU this is: its model name and ISA flags, read from /proc/cpuinfo.

A timing depends on the machine, so the knowledge base keys its figures by the CPU model, and
the benchmarks record the ISA (native bf16 above all) with every figure::

    name, flags = cpu_info()      # ("Intel(R) Xeon(R) Processor", frozenset({"avx512f", ...}))
    cpu_model()                   # the name alone
"""
from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)  # the CPU does not change under a process; keys ask often
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and ISA flags from /proc/cpuinfo (x86's ``flags`` line, ARM's
    ``Features``); without it, the platform's processor string and no flags."""
    try:
        with open("/proc/cpuinfo") as f:
            name, flags = parse_cpuinfo(f)
    except OSError:
        name, flags = "", frozenset()
    import platform
    return name or platform.processor() or platform.machine() or "unknown CPU", flags


def parse_cpuinfo(lines: Any) -> tuple[str, frozenset[str]]:
    """The first processor's model name and ISA flags from /proc/cpuinfo's lines::

        parse_cpuinfo(["model name : AMD EPYC", "flags : fpu avx2"])
        # ('AMD EPYC', frozenset({'fpu', 'avx2'}))
    """
    name, flags = "", set()
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        if name and flags:
            break
    return name, frozenset(flags)


def cpu_model() -> str:
    """The CPU's model name (see cpu_info)."""
    return cpu_info()[0]
