"""Which CPU this is: its model name and ISA flags, read from /proc/cpuinfo.

A timing depends on the machine, so the knowledge base keys its figures by the CPU model, and
the benchmarks record the ISA (native bf16 above all) with every figure. On x86 the name carries
the processor's family and model numbers: a virtual machine may name every CPU alike ("AMD
EPYC" for a Zen 4 and a Zen 5, family 25 and 26), and figures measured on one are no verdict on
the other (oneDNN's linear ran the matrix products of a GLM step in half `aten::mm`'s time on
the Zen 5, 2-core, fp32)::

    name, flags = cpu_info()      # ("AMD EPYC (family 26, model 2)", frozenset({"avx512f", ...}))
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
        parse_cpuinfo(["cpu family : 26", "model : 2", "model name : AMD EPYC"])
        # ('AMD EPYC (family 26, model 2)', frozenset())
    """
    name, flags, numbers = "", set(), {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key in ("cpu family", "model") and key not in numbers:  # x86's, before its flags
            numbers[key] = value.strip()
        if name and flags:
            break
    if name and len(numbers) == 2:
        name = f"{name} (family {numbers['cpu family']}, model {numbers['model']})"
    return name, frozenset(flags)


def cpu_model() -> str:
    """The CPU's model name (see cpu_info)."""
    return cpu_info()[0]
