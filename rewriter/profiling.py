"""Operator tables from one profiled run of a step, for the report's before/after view.

The profiled run happens outside the timed runs, so the profiler's overhead never enters a
decision::

    rows = profile_step(step, backend, top_k=10)
    # [OpRow(name='aten::addmm', calls=24, self_ms=3.1, total_ms=3.4, share=0.41), ...]
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpRow:
    name: str
    calls: int
    self_ms: float
    total_ms: float
    share: float  # of the step's summed self time

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def profile_step(run: Callable[[], None], activities: list, top_k: int = 10) -> list[OpRow]:
    """Profile one call of ``run`` and return its top operators by self time."""
    with torch.profiler.profile(activities=list(dict.fromkeys(activities))) as prof:
        run()
    device_attr = next((a for a in ("self_device_time_total", "self_cuda_time_total")
                        if any(getattr(e, a, 0) for e in prof.key_averages())), None)
    rows = []
    for e in prof.key_averages():
        self_us = e.self_cpu_time_total + (getattr(e, device_attr, 0) if device_attr else 0)
        rows.append((e.key, e.count, self_us, e.cpu_time_total))
    total = sum(r[2] for r in rows) or 1.0
    rows.sort(key=lambda r: r[2], reverse=True)
    return [OpRow(name, calls, self_us / 1e3, total_us / 1e3, self_us / total)
            for name, calls, self_us, total_us in rows[:top_k]]
