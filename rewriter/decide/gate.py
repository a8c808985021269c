"""The gate: measure two variants side by side and decide whether to keep one.

Baseline and candidate run interleaved in one process after a warm-up, in alternating order
(A B, B A, A B, ...) so drift in clock speed or cache state hits both alike. The decision reads
the median of the paired ratios ``t_baseline / t_candidate`` and its noise, the standard error of
that median estimated from the ratios' spread (1.4826 * MAD, times 1.2533 / sqrt(n))::

    m = measure(baseline, candidate, clock=WallClock(backend.synchronize), settings=GateSettings())
    keep, reason = decide(m, min_speedup=1.05)

A candidate is kept only when its speedup is at least ``min_speedup`` and the speedup less two
noise widths is still above 1: a result the noise could explain is no result.

A busy machine: load from other processes only ever makes a sample slower, so a sample far
above its own variant's lower decile (``outlier_factor`` times it) is flagged and left out
of the statistics. When more than ``max_flagged`` of the pairs are flagged, the comparison is
measured again once; flagged again, it is "inconclusive: the machine was busy", never a keep.
Not flagged: a slow sample that took far more of this process's page faults than its variant
usually does (:func:`faults_explain`). Another process's load does not fault our pages; a
variant whose allocations sometimes land on fresh memory (glibc maps a tensor over its mmap
threshold afresh, and trims its heap) is that slow when it runs, so those samples are its cost.

The variants are whole steps (``scope="step"``) or one site's region (``scope="region"``,
repeated ``reps`` times per sample so a sample is well above the timer's resolution).
Unit tests replace the clock by one that returns controlled times (``tests/controlled.py``);
real timings belong in benchmarks.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One runnable variant of the user's step. ``passes`` names the rewrites it contains."""

    run: Callable[[], None]
    passes: tuple[str, ...]
    label: str
    scope: str = "step"  # "step" (the user's whole step), "region" (one site's region), "optimizer"
    reps: int = 1        # runs of the region per sample
    # run before each timed sample, untimed (a region's: the heap as a step leaves it)
    before_sample: Callable[[], None] | None = None


class Clock(Protocol):
    def time(self, step: Step) -> float:
        """Run ``step`` once and return its duration in seconds."""


class WallClock:
    """Host clock around a device-synchronised step (seconds per run of the region or step)."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None) -> None:
        self.synchronize = synchronize

    def time(self, step: Step) -> float:
        self.synchronize()
        start = time.perf_counter()
        step.run()
        self.synchronize()
        return time.perf_counter() - start

    @staticmethod
    def page_faults() -> int | None:
        """This process's minor page faults so far (None where not counted): see the module."""
        return host_page_faults()


def host_page_faults() -> int | None:
    """This process's minor page faults so far (fresh pages the kernel mapped and zeroed), or
    None where the platform does not count them."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class EventClock:
    """Device-side timer: events recorded on the device's stream around the step (CUDA events,
    or torch_npu's ``torch.npu.Event``), so host-side jitter does not enter the sample."""

    def __init__(self, device_module: Any) -> None:
        self.device = device_module

    def time(self, step: Step) -> float:
        start = self.device.Event(enable_timing=True)
        end = self.device.Event(enable_timing=True)
        start.record()
        step.run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def device_clock(backend: Any) -> Clock:
    """The best clock the backend has: device events on CUDA and NPU, else the host clock."""
    import torch
    module = {"cuda": getattr(torch, "cuda", None), "npu": getattr(torch, "npu", None)}.get(backend.name)
    if module is not None and hasattr(module, "Event"):
        return EventClock(module)
    return WallClock(backend.synchronize)


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
    region_sample_seconds: float = 0.003  # a region sample repeats the region this long
    region_warmup_seconds: float = 0.05   # a region (and the optimizer step) is small: settles fast
    region_max_pairs: int = 200  # region samples are short: more pairs, same budget
    region_min_pairs: int = 10   # and no early verdict on a handful of them (long ones: a step's)
    # a region that sits near the margin is not measured for ever: past this, its figures
    # decide (kept only when clear of the margin by its noise)
    region_budget_seconds: float = 1.5
    # ... nor once its figures, noise widths and all, lie within this of min_speedup (or at
    # best do): kept or not, the step then moves by under this share of the region
    # (gate.conclusive_or_on_the_line; BERT's fuse_attention region read 1.049x ±0.005 after
    # 127 pairs, 1.6 s of a cold optimize(), 2-core AMD EPYC)
    region_indifference: float = 0.02
    negligible: float = 0.001    # a region saving less than this share of the step is not kept
    # a whole-step decision (a pass, the precision, the optimizer, a compile) may stop at these
    # few pairs when every one, none flagged, lies beyond min_speedup by this share on the same
    # side, each variant's samples within it of each other, and the figures are conclusive:
    # a 0.6 s step pays 1.2 s a pair (gate.clearly_one_way)
    step_early_pairs: int = 4
    step_early_margin: float = 0.10
    confirm_pairs: int = 4  # the step check: fewest pairs (the models ran warm just before)
    confirm_unanimous_pairs: int = 2  # ... fewer when every one of these points faster
    outlier_factor: float = 1.5  # a sample this many times its variant's lower decile is flagged
    max_flagged: float = 0.25    # more flagged pairs than this: measure again, then inconclusive
    regression: float = 0.98     # the step check reverts only below this ratio (and the noise)


def ran_warm(settings: GateSettings) -> GateSettings:
    """``settings`` for two steps that have both run warm before they are compared (a compiled
    step after its compile and verification, the rewritten one after the step check): one
    warm-up round, where a second would cost a pair's time (Granite fp32: 0.5 s of a cold
    optimize(), 2-core AMD EPYC)."""
    return replace(settings, warmup=1, warmup_seconds=0.0)


def saved_ms(figures: dict | None) -> float | None:
    """The saving, in ms, that a measurement's figures (``Measurement.to_dict()``, or a
    knowledge-base entry holding them) show, or None when either time is missing."""
    if not figures or figures.get("baseline_ms") is None or figures.get("candidate_ms") is None:
        return None
    return figures["baseline_ms"] - figures["candidate_ms"]


@dataclass
class Measurement:
    baseline_times: list[float] = field(default_factory=list)
    candidate_times: list[float] = field(default_factory=list)
    outlier_factor: float = math.inf
    reps: int = 1
    remeasured: bool = False  # the first try had too many flagged samples
    busy: bool = False        # so had the second: no conclusion
    earlier: tuple[list[float], list[float]] | None = None  # an earlier try's samples
    out_of_time: bool = False  # stopped by the deadline before the fewest pairs
    decided_early: bool = False  # stopped before the fewest pairs: the caller's ``early`` rule
    decided_out_of_time: bool = False  # cut short by the deadline, answered (OneWay.out_of_time)
    # each sample's page faults (this process's), where the clock counts them
    baseline_faults: list[int] = field(default_factory=list)
    candidate_faults: list[int] = field(default_factory=list)

    def _slow_and_own(self) -> list[tuple[bool, bool]]:
        """Per sample, baseline's then candidate's: (far above its variant's usual, lower-decile,
        time; explained by its own page faults)."""
        earlier_a, earlier_b = self.earlier or ([], [])
        f, n = self.outlier_factor, len(self.baseline_times)
        result = []
        for times, earlier, faults in ((self.baseline_times, earlier_a, self.baseline_faults),
                                       (self.candidate_times, earlier_b, self.candidate_faults)):
            lo = _lower_decile(times + earlier)
            result += zip([t > f * lo for t in times], faults_explain(faults, n))
        return result

    @property
    def flagged(self) -> list[bool]:
        """Per pair: a sample of it far above its own variant's usual time, not explained by
        its own page faults."""
        if not self.baseline_times:
            return []
        n = len(self.baseline_times)
        bad = [slow and not own for slow, own in self._slow_and_own()]
        return [a or b for a, b in zip(bad[:n], bad[n:])]

    @property
    def slow_with_own_faults(self) -> int:
        """Slow samples kept in because their own page faults account for them."""
        if not self.baseline_times:
            return 0
        return sum(slow and own for slow, own in self._slow_and_own())

    @property
    def flagged_fraction(self) -> float:
        flags = self.flagged
        return sum(flags) / len(flags) if flags else 0.0

    def _good(self) -> list[tuple[float, float]]:
        return [(a, b) for (a, b), bad in zip(zip(self.baseline_times, self.candidate_times),
                                              self.flagged) if not bad and b > 0]

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in self._good()]

    @property
    def pairs(self) -> int:
        return len(self.ratios)

    @property
    def faults_counted(self) -> bool:
        """Slow samples were kept in for their own page faults: fresh memory is part of what a
        variant costs, as often as it comes, so the variants are compared on their means. The
        median of the ratios takes one mode or the other: BERT's loss region, fp32, 2-core AMD
        EPYC, its original 5.5 ms or, mapping 32 MB afresh (8000 faults) in about half its
        samples, 11.5 ms, the fused loss 7 ms without faults: 0.83x / 0.89x / 1.56x over three
        decisions in one process, kept once."""
        return self.slow_with_own_faults > 0

    @property
    def speedup(self) -> float:
        good = self._good()
        if not good:
            return math.nan
        if self.faults_counted:
            return sum(a for a, _ in good) / sum(b for _, b in good)
        return statistics.median(self.ratios)

    @property
    def noise(self) -> float:
        """Standard error of the median ratio (robust: from the median absolute deviation), or,
        where faults count (:attr:`faults_counted`), of the ratio of the means (the delta
        method: the spread of ``a - speedup * b`` over the candidate's mean)."""
        r = self.ratios
        if len(r) < 2:
            return math.inf
        if self.faults_counted:
            good, s = self._good(), self.speedup
            mean_b = statistics.fmean(b for _, b in good)
            return statistics.stdev(a - s * b for a, b in good) / (mean_b * math.sqrt(len(good)))
        med = statistics.median(r)
        mad = statistics.median(abs(x - med) for x in r)
        return 1.2533 * 1.4826 * mad / math.sqrt(len(r))

    @property
    def baseline_ms(self) -> float:
        """Median time of one run of the baseline (a region sample divided by its repeats); its
        mean where faults count."""
        good = self._good()
        if not good:
            return math.nan
        mid = statistics.fmean if self.faults_counted else statistics.median
        return 1e3 * mid(a for a, _ in good) / self.reps

    @property
    def candidate_ms(self) -> float:
        """The baseline's time divided by the speedup, so the two figures always agree."""
        s = self.speedup
        return self.baseline_ms / s if s and math.isfinite(s) else math.nan

    @property
    def saved_ms(self) -> float:
        return self.baseline_ms - self.candidate_ms

    def storable(self, min_pairs: int) -> bool:
        """Worth a knowledge-base entry: completed on enough pairs (or answered before them by
        the caller's ``early`` rule), not spoiled by a busy machine."""
        return not self.busy and not self.out_of_time and (self.pairs >= min_pairs or self.decided_early)

    def to_dict(self) -> dict:
        return {"speedup": _finite(self.speedup), "noise": _finite(self.noise), "pairs": self.pairs,
                "baseline_ms": _finite(self.baseline_ms), "candidate_ms": _finite(self.candidate_ms),
                "flagged": sum(self.flagged), "slow_with_own_faults": self.slow_with_own_faults,
                "reps": self.reps, "remeasured": self.remeasured,
                "busy": self.busy, "out_of_time": self.out_of_time}


def _lower_decile(times: list[float]) -> float:
    """Load only ever slows a sample down: the lower decile is the variant's unloaded time
    even when a burst hit most samples, and a load that lasts the whole comparison (which
    slows both variants alike) moves it with the samples."""
    ordered = sorted(times)
    return ordered[(len(ordered) - 1) // 10]


FAULT_SLACK = 256  # page faults (1 MiB of 4 KiB pages) any sample may take beyond the usual


def faults_explain(faults: list[int], samples: int) -> list[bool]:
    """Per sample (all False without a count for each): far more page faults than the
    variant's usual (lower-decile) count, twice it and ``FAULT_SLACK`` more: fresh memory
    this sample mapped."""
    if len(faults) != samples or not faults:
        return [False] * samples
    usual = sorted(faults)[(len(faults) - 1) // 10]
    return [n > 2 * usual + FAULT_SLACK for n in faults]


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


def _conclusive(m: Measurement, min_speedup: float, widths: float) -> bool:
    """True once more pairs could not change the decision's direction."""
    s, n = m.speedup, m.noise
    return s - widths * n > max(1.0, min_speedup) or s + widths * n < min_speedup


def conclusive_or_on_the_line(min_speedup: float, band: float, widths: float
                               ) -> Callable[[Measurement], bool]:
    """``enough`` for a region's comparison (:func:`measure`): more pairs could not change the
    decision's direction, or the truth sits on the line, where keeping and rejecting differ by
    less than ``band`` of the region, and the verdict goes by where the figure stands
    (:func:`decide`): the figures, ``widths`` noise widths either side, lie within ``band`` of
    ``min_speedup``, or even ``widths + 1`` widths above the figure lies within it (at best on
    the line). Without the last, a region a little short of the margin is measured until its
    noise proves it short: LLaMA fp32, 2-core AMD EPYC, cold optimize(): its QKV projections
    1.019x ±0.015 after 30 pairs, its down projection under oneDNN 1.028x ±0.011 after 36, its
    RMSNorm 0.997x ±0.023 after 39. One width further than the verdict's reach, as stopping on a
    low draw is what it risks: truly 1.08x, samples +-10 % (controlled clock, 20 seeds), kept
    20 times with it, 18 with ``widths``; truly 1.03x, 22 % fewer pairs."""
    def enough(m: Measurement) -> bool:
        s, n = m.speedup, m.noise
        if _conclusive(m, min_speedup, widths):
            return True
        if not (math.isfinite(s) and math.isfinite(n)):
            return False
        return (min_speedup - band <= s - widths * n and s + widths * n <= min_speedup + band) \
            or s + (widths + 1) * n <= min_speedup + band
    return enough


class OneWay:
    """:func:`clearly_one_way`'s rule (``early(m)``), and :meth:`out_of_time`: the verdict a
    measurement cut short by the deadline still gives."""

    def __init__(self, min_speedup: float, settings: GateSettings) -> None:
        self.g = settings
        margin = 1 + settings.step_early_margin
        self.fast, self.slow, self.min_speedup = min_speedup * margin, min_speedup / margin, min_speedup

    def _tight(self, times: list[float]) -> bool:
        return max(times) <= (1 + self.g.step_early_margin) * min(times)

    def __call__(self, m: Measurement) -> bool:
        r = m.ratios
        return len(r) >= self.g.step_early_pairs and (min(r) >= self.fast or max(r) <= self.slow) \
            and self._tight(m.baseline_times) and self._tight(m.candidate_times) \
            and _conclusive(m, self.min_speedup, self.g.noise_widths)

    def out_of_time(self, m: Measurement) -> bool:
        """Cut short by the deadline after ``step_early_pairs`` pairs (none flagged), a verdict
        where every sample of one variant lies beyond every sample of the other by the margin and
        the figures are conclusive, without the rule's spread within each variant: on a noisy
        machine a step's samples spread past 10 % (2-core EPYC, bf16 at steps=100: LLaMA's eager
        step 274-340 ms over five pairs against 171-200 ms in bf16, and ``cast_to_half`` read "not
        reached" in four runs of five). Truly level variants whose samples half the time take a
        1.2-3x burst of load pass it in 0.17 % of tries at four pairs, 0.02 % at five (200 000
        simulated), against none kept before: a keep then changes nothing in time."""
        b, c = m.baseline_times, m.candidate_times
        return len(b) >= self.g.step_early_pairs and len(c) == len(b) and (
            min(b) >= self.fast * max(c) or max(b) * self.fast <= min(c)) \
            and _conclusive(m, self.min_speedup, self.g.noise_widths)


def clearly_one_way(min_speedup: float, settings: GateSettings) -> OneWay:
    """``early`` for a decision on the whole step (:func:`measure`): answered before the fewest
    pairs once at least ``step_early_pairs`` pairs (none flagged: measure asks only then) all
    lie beyond ``min_speedup`` by ``step_early_margin``, faster or slower alike, each variant's
    samples lie within that share of each other, and the figures are conclusive.

    With a step's noise of ~2-3 %, four pairs each 10 % past the line while the truth sits on
    it take four errors of 3-5 noise widths in one direction. Load from another process, which
    slows whatever runs while it lasts, fools it only by slowing all four samples of one
    variant, alike within 10 %, and none of the other's (a burst in each sample with chance p:
    p**4 (1-p)**4, at most 0.4 %, and rarer still alike; without this rule, the six fewest
    pairs: p**6 (1-p)**6). A kept fused AdamW (2.8x), precision (1.8x), loss (1.2x) or compile
    (1.25x) is past it and stops there (LLaMA, bf16, the Xeon with AMX, `.diag` run: the whole-
    step measuring 7.5 -> 6.0 s)."""
    return OneWay(min_speedup, settings)


def measure(baseline: Step, candidate: Step, *, clock: Clock, settings: GateSettings,
            min_speedup: float = 1.0, deadline: float | None = None,
            enough: Callable[[Measurement], bool] | None = None,
            early: Callable[[Measurement], bool] | None = None) -> Measurement:
    """Interleaved A/B timing of two variants; stops early once the result is conclusive, at
    the settings' budget, or at ``deadline`` (a ``time.perf_counter()`` value), after
    ``min_pairs`` in any case. Too many flagged samples: measured once more (see the module).

    ``enough``: when the pairs so far answer the caller's question (default: more pairs could
    not change the keep/reject decision under ``min_speedup``). ``early``: when fewer than
    ``min_pairs`` pairs, none flagged, already answer it (the step check's unanimous pairs)."""
    if not _warm_up(baseline, candidate, settings, deadline):
        return Measurement(outlier_factor=settings.outlier_factor, reps=max(baseline.reps, 1),
                           out_of_time=True)
    if enough is None:
        def enough(m: Measurement) -> bool:
            return _conclusive(m, min_speedup, settings.noise_widths)
    m = _pairs(baseline, candidate, clock, settings, enough, deadline, early=early)
    if m.flagged_fraction > settings.max_flagged and not m.out_of_time \
            and (deadline is None or time.perf_counter() < deadline):
        log.info("rewriter: %s vs %s: %d of %d samples far above their variant's usual time (a busy "
                 "machine?); measuring again", baseline.label, candidate.label, sum(m.flagged),
                 len(m.flagged))
        earlier = (m.baseline_times, m.candidate_times)
        m = _pairs(baseline, candidate, clock, settings, enough, deadline, earlier, early)
        m.remeasured = True
        m.busy = m.flagged_fraction > settings.max_flagged
    elif m.flagged_fraction > settings.max_flagged:
        m.busy = True  # no time left to measure again
    return m


def _warm_up(baseline: Step, candidate: Step, settings: GateSettings, deadline: float | None) -> bool:
    """Run both variants untimed until caches settle. Like a pair, a warm-up round is not
    started that would end past the deadline (predicted from the longest round so far); False
    when the deadline cuts the warm-up short, so nothing would be timed warm."""
    warm_start = time.perf_counter()
    longest = 0.0
    for i in range(max(settings.warmup, settings.max_warmup)):
        now = time.perf_counter()
        if i >= settings.warmup and now - warm_start >= settings.warmup_seconds:
            break
        if _next_ends_past(deadline, longest):
            return False
        baseline.run()
        candidate.run()
        longest = max(longest, time.perf_counter() - now)
    return True


def _next_ends_past(deadline: float | None, longest: float) -> bool:
    """A round started now that takes as long as the longest so far would end past ``deadline``."""
    return deadline is not None and time.perf_counter() + longest > deadline


def _pairs(baseline: Step, candidate: Step, clock: Clock, settings: GateSettings,
           enough: Callable[[Measurement], bool], deadline: float | None,
           earlier: tuple[list[float], list[float]] | None = None,
           early: Callable[[Measurement], bool] | None = None) -> Measurement:
    m = Measurement(outlier_factor=settings.outlier_factor, reps=max(baseline.reps, 1),
                    earlier=earlier)
    started = time.perf_counter()
    longest = 0.0  # wall time of the longest pair so far: the next one may take as long
    for i in range(settings.max_pairs):
        first, second = (baseline, candidate) if i % 2 == 0 else (candidate, baseline)
        t0 = time.perf_counter()
        sample_first, sample_second = _timed(clock, first), _timed(clock, second)
        longest = max(longest, time.perf_counter() - t0)
        (a, fa), (b, fb) = ((sample_first, sample_second) if first is baseline
                            else (sample_second, sample_first))
        m.baseline_times.append(a)
        m.candidate_times.append(b)
        if fa is not None and fb is not None:
            m.baseline_faults.append(fa)
            m.candidate_faults.append(fb)
        if early is not None and i + 1 < settings.min_pairs and not any(m.flagged) and early(m):
            m.decided_early = True
            break
        # A pair is not started that would end past the deadline (a 1 s step makes 2 s pairs).
        past_deadline = _next_ends_past(deadline, longest)
        if past_deadline and i + 1 < settings.min_pairs:
            out_of_time = getattr(early, "out_of_time", None)
            if out_of_time is not None and not any(m.flagged) and out_of_time(m):
                m.decided_out_of_time = True  # the pairs so far separate the variants (OneWay)
                break
            m.out_of_time = True  # the budget ends here: no verdict from a few pairs
            break
        if i + 1 >= settings.min_pairs and (
                (m.flagged_fraction <= settings.max_flagged and enough(m))
                or time.perf_counter() - started > settings.budget_seconds or past_deadline):
            break
    return m


def _timed(clock: Clock, step: Step) -> tuple[float, int | None]:
    """One sample: its time, and the page faults it took where the clock counts them."""
    if step.before_sample is not None:
        step.before_sample()
    faults = getattr(clock, "page_faults", None)
    before = faults() if faults is not None else None
    t = clock.time(step)
    after = faults() if before is not None else None
    return t, (after - before if before is not None and after is not None else None)


def figure(m: Measurement) -> str:
    """The measurement in words; the two times agree with the ratio by construction."""
    flagged, own = sum(m.flagged), m.slow_with_own_faults
    extra = f", {flagged} flagged sample(s) left out" if flagged else ""
    extra += f", {own} slow sample(s) kept in: their own page faults (means compared)" if own else ""
    return _figure(m.speedup, m.noise, m.pairs, m.baseline_ms, m.candidate_ms, extra)


def _figure(s: float, n: float, pairs: int, base_ms: float | None, cand_ms: float | None,
            extra: str = "") -> str:
    times = (f" ({base_ms:.3f} ms -> {cand_ms:.3f} ms)"
             if base_ms is not None and cand_ms is not None else "")
    return f"{s:.3f}x ±{n:.3f} over {pairs} pairs{extra}{times}"


def decide(m: Measurement, min_speedup: float, noise_widths: float = 2.0) -> tuple[bool, str]:
    """Keep or not, and the reason in words."""
    if m.out_of_time:
        return False, f"not reached: the time budget ran out after {len(m.baseline_times)} pair(s)"
    if m.busy:
        return False, (f"inconclusive: the machine was busy ({sum(m.flagged)} of {len(m.flagged)} "
                       f"samples over {m.outlier_factor:g}x their variant's usual time, measured twice)")
    if not math.isfinite(m.speedup) or m.pairs < 2:
        return False, "no measurement"
    keep, reason = _verdict(m.speedup, m.noise, min_speedup, noise_widths, figure(m))
    if m.decided_out_of_time:
        reason += "; the time budget ended the pairs, every sample of one variant apart from the other's"
    return keep, reason


def verdict(speedup: float, noise: float, pairs: int, min_speedup: float, noise_widths: float,
            baseline_ms: float | None = None, candidate_ms: float | None = None) -> tuple[bool, str]:
    """:func:`decide` for stored figures (the knowledge base), under today's margin."""
    if speedup is None or noise is None or not math.isfinite(speedup) or pairs < 2:
        return False, "no measurement"
    return _verdict(speedup, noise, min_speedup, noise_widths,
                    _figure(speedup, noise, pairs, baseline_ms, candidate_ms))


def known_verdict(known: dict, min_speedup: float, noise_widths: float) -> tuple[bool, str]:
    """:func:`verdict` for a knowledge-base entry (rewriter.decide.knowledge), under today's margin;
    the reason says where the figures came from."""
    keep, reason = verdict(known["speedup"], known["noise"], known["pairs"], min_speedup,
                           noise_widths, known["baseline_ms"], known["candidate_ms"])
    return keep, f"{reason} (knowledge base, measured {known.get('recorded', '')})"


def clear_of_one(speedup: float, noise: float, widths: float) -> bool:
    """Whether a speedup is above 1 by more than ``widths`` noise widths: faster, not noise."""
    return speedup - widths * noise > 1.0


def _verdict(s: float, n: float, min_speedup: float, noise_widths: float, text: str) -> tuple[bool, str]:
    if s < 1.0:
        return False, f"slower: {text}"
    if s < min_speedup:
        return False, f"below min_speedup {min_speedup:g}: {text}"
    if not clear_of_one(s, n, noise_widths):
        return False, f"within noise: {text}"
    return True, f"faster: {text}"
