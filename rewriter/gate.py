"""The gate: measure two variants of the step side by side and decide whether to keep one.

Baseline and candidate run interleaved in one process after a warm-up, in alternating order
(A B, B A, A B, ...) so drift in clock speed or cache state hits both alike. The decision reads
the median of the paired ratios ``t_baseline / t_candidate`` and its noise, the standard error of
that median estimated from the ratios' spread (1.4826 * MAD, times 1.2533 / sqrt(n))::

    m = measure(baseline, candidate, clock=WallClock(backend), settings=GateSettings())
    keep, reason = decide(m, min_speedup=1.03)

A candidate is kept only when its speedup is at least ``min_speedup`` and the speedup less two
noise widths is still above 1: a result the noise could explain is no result.

Unit tests replace :class:`WallClock` by a clock that returns controlled times (see
``tests/controlled.py``); real timings belong in benchmarks.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One runnable variant of the user's step. ``passes`` names the rewrites it contains."""

    run: Callable[[], None]
    passes: tuple[str, ...]
    label: str


class Clock(Protocol):
    def time(self, step: Step) -> float:
        """Run ``step`` once and return its duration in seconds."""


class WallClock:
    """Host clock around a device-synchronised step."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None) -> None:
        self.synchronize = synchronize

    def time(self, step: Step) -> float:
        self.synchronize()
        start = time.perf_counter()
        step.run()
        self.synchronize()
        return time.perf_counter() - start


@dataclass(frozen=True)
class GateSettings:
    """How long to measure. The budget is per comparison; the pair counts bound it."""

    warmup: int = 2
    warmup_seconds: float = 0.5  # caches, allocator and thread pools settle before timing
    max_warmup: int = 10
    min_pairs: int = 6
    max_pairs: int = 40
    budget_seconds: float = 4.0
    noise_widths: float = 2.0


@dataclass
class Measurement:
    baseline_times: list[float] = field(default_factory=list)
    candidate_times: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.baseline_times, self.candidate_times) if b > 0]

    @property
    def pairs(self) -> int:
        return len(self.ratios)

    @property
    def speedup(self) -> float:
        return statistics.median(self.ratios) if self.ratios else math.nan

    @property
    def noise(self) -> float:
        """Standard error of the median ratio (robust: from the median absolute deviation)."""
        r = self.ratios
        if len(r) < 2:
            return math.inf
        med = statistics.median(r)
        mad = statistics.median(abs(x - med) for x in r)
        return 1.2533 * 1.4826 * mad / math.sqrt(len(r))

    @property
    def baseline_ms(self) -> float:
        return 1e3 * statistics.median(self.baseline_times) if self.baseline_times else math.nan

    @property
    def candidate_ms(self) -> float:
        return 1e3 * statistics.median(self.candidate_times) if self.candidate_times else math.nan

    def to_dict(self) -> dict:
        return {"speedup": _finite(self.speedup), "noise": _finite(self.noise), "pairs": self.pairs,
                "baseline_ms": _finite(self.baseline_ms), "candidate_ms": _finite(self.candidate_ms)}


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


def _conclusive(m: Measurement, min_speedup: float, widths: float) -> bool:
    """True once more pairs could not change the decision's direction."""
    s, n = m.speedup, m.noise
    return s - widths * n > max(1.0, min_speedup) or s + widths * n < min_speedup


def measure(baseline: Step, candidate: Step, *, clock: Clock, settings: GateSettings,
            min_speedup: float = 1.0) -> Measurement:
    """Interleaved A/B timing of two steps; stops early once the result is conclusive."""
    warm_start = time.perf_counter()
    for i in range(max(settings.warmup, settings.max_warmup)):
        if i >= settings.warmup and time.perf_counter() - warm_start >= settings.warmup_seconds:
            break
        baseline.run()
        candidate.run()
    m = Measurement()
    started = time.perf_counter()
    for i in range(settings.max_pairs):
        first, second = (baseline, candidate) if i % 2 == 0 else (candidate, baseline)
        t_first, t_second = clock.time(first), clock.time(second)
        a, b = (t_first, t_second) if first is baseline else (t_second, t_first)
        m.baseline_times.append(a)
        m.candidate_times.append(b)
        if i + 1 >= settings.min_pairs and (
                _conclusive(m, min_speedup, settings.noise_widths)
                or time.perf_counter() - started > settings.budget_seconds):
            break
    return m


def decide(m: Measurement, min_speedup: float, noise_widths: float = 2.0) -> tuple[bool, str]:
    """Keep or not, and the reason in words."""
    s, n = m.speedup, m.noise
    figure = f"{s:.3f}x ±{n:.3f} over {m.pairs} pairs ({m.baseline_ms:.2f} ms -> {m.candidate_ms:.2f} ms)"
    if not math.isfinite(s):
        return False, "no measurement"
    if s < 1.0:
        return False, f"slower: {figure}"
    if s < min_speedup:
        return False, f"below min_speedup {min_speedup:g}: {figure}"
    if s - noise_widths * n <= 1.0:
        return False, f"within noise: {figure}"
    return True, f"faster: {figure}"
