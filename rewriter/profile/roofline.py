"""Roofline: each operator (and each of its input-shape signatures) against the device's two
roofs, peak compute and memory bandwidth (:mod:`rewriter.profile.peaks`).

    from rewriter.profile.roofline import roofline_rows, plot_roofline

    rows = roofline_rows(calls, peaks, steps=2)      # one per operator, by time
    rows[0].bound, rows[0].roof_fraction             # 'compute', 0.35
    plot_roofline(rows, peaks, "roofline.png")        # None without matplotlib

An operator with arithmetic intensity ``I`` (FLOPs per byte) can at best run at
``min(peak_flops, I * peak_bandwidth)``: below the ridge point ``peak_flops / peak_bandwidth``
it is memory-bound, above compute-bound. ``roof_fraction`` is its achieved rate over that
roof: for a compute-bound operator the fraction of peak FLOP/s, for a memory-bound one the
fraction of peak bandwidth. Bytes are a lower bound (tensor sizes, :mod:`rewriter.profile.opcost`), so a
memory-bound fraction is a lower bound too. Times are profiled self times (profiler overhead
included): on a CPU host time, on CUDA/NPU device time.
"""
from __future__ import annotations

import logging
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Sequence

from rewriter.profile.attribution import Origin
from rewriter.profile.opcalls import OpCall, Signature
from rewriter.profile.peaks import Peaks

log = logging.getLogger(__name__)

__all__ = ["RooflineRow", "roofline_rows", "plot_roofline", "describe_origins", "group_origins"]


@dataclass(frozen=True)
class RooflineRow:
    """One operator (``signature`` None) or one of its input-shape signatures, per step:
    ``ms`` of self time of the calls that have a cost, their ``flops`` and ``bytes``, and the
    roofline verdict against ``peaks`` (``bound``, ``roof_fraction``). ``origins`` are
    (origin, backward seen, forward seen, share of this row's time), largest first."""

    name: str
    signature: Signature | None
    dtype: str
    kind: str
    calls: int
    ms: float
    share: float  # of the step's operator time
    flops: float
    bytes: float
    roof_gflops: float | None = None  # the attainable rate at this intensity
    bound: str = ""  # "compute" | "memory" | "" (no peaks)
    roof_fraction: float | None = None
    origins: tuple[tuple[Origin, bool, bool, float], ...] = ()
    peak_gb_per_s: float = 0.0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def gflops_per_s(self) -> float:
        return self.flops / self.ms / 1e6 if self.ms > 0 else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.ms / 1e6 if self.ms > 0 else 0.0

    @property
    def us_per_call(self) -> float:
        return 1e3 * self.ms / self.calls if self.calls else 0.0

    def verdict(self) -> str:
        """``compute-bound, 35% of its roof (62 GFLOP/s of 180)``."""
        if not self.bound or self.roof_fraction is None:
            return "no peaks to compare with"
        if self.bound == "compute":
            text = (f"compute-bound, {100 * self.roof_fraction:.0f}% of peak compute "
                    f"({self.gflops_per_s:,.1f} of {self.roof_gflops:,.0f} GFLOP/s)")
            if self.roof_fraction > 1.05:
                text += " (above the peak: a measurement on a busy machine is low; --peaks measure measures again)"
            return text
        peak_bw = self.roof_gflops / self.intensity if self.intensity and self.roof_gflops else self.peak_gb_per_s
        text = (f"memory-bound, {100 * self.roof_fraction:.0f}% of peak bandwidth "
                f"({self.gb_per_s:,.1f} of {peak_bw:,.0f} GB/s)")
        if self.roof_fraction > 1.05:
            text += " (above the memory roof: its data stay in cache)"
        return text

    def to_dict(self) -> dict:
        return {"name": self.name, "signature": [list(s) for s in self.signature] if self.signature else None,
                "dtype": self.dtype, "kind": self.kind, "calls": self.calls, "ms": round(self.ms, 4),
                "share": round(self.share, 4), "flops": self.flops, "bytes": self.bytes,
                "intensity": None if math.isinf(self.intensity) else round(self.intensity, 3),
                "gflops_per_s": round(self.gflops_per_s, 3), "gb_per_s": round(self.gb_per_s, 3),
                "bound": self.bound, "roof_gflops": self.roof_gflops,
                "roof_fraction": None if self.roof_fraction is None else round(self.roof_fraction, 4),
                "origins": [{**o.to_dict(), "forward": fwd, "backward_seen": bwd, "share": round(sh, 4)}
                            for o, bwd, fwd, sh in self.origins]}


def describe_origins(origins: Sequence[tuple[Origin, bool, bool, float]], limit: int = 1) -> str:
    """``Block.forward model.py:7 `y = x @ w`, and its backward`` for the top ``limit`` origins."""
    parts = []
    for origin, bwd, fwd, share in origins[:limit]:
        text = origin.describe()
        if bwd and fwd:
            text += ", and its backward"
        elif bwd:
            text = "backward of " + text
        if len(origins) > 1:
            text += f" ({100 * share:.0f}%)"
        parts.append(text)
    if len(origins) > limit:
        parts.append(f"{len(origins) - limit} more line(s)")
    return "; ".join(parts)


def _dtype(calls: Sequence[OpCall]) -> str:
    found = Counter(d for c in calls for d in c.dtypes[:1] if d and d not in ("Scalar", "ScalarList"))
    return found.most_common(1)[0][0] if found else ""


def group_origins(calls: Sequence[OpCall]) -> tuple[tuple[Origin, bool, bool, float], ...]:
    """(forward origin, backward seen, forward seen, share of time) of calls, largest first."""
    time: dict[Origin, float] = defaultdict(float)
    bwd: dict[Origin, bool] = defaultdict(bool)
    fwd: dict[Origin, bool] = defaultdict(bool)
    for c in calls:
        if c.origin is None:
            continue
        key = c.origin.forward()
        time[key] += c.self_us
        bwd[key] |= c.origin.backward
        fwd[key] |= not c.origin.backward
    total = sum(time.values()) or 1.0
    ranked = sorted(time, key=lambda o: -time[o])
    return tuple((o, bwd[o], fwd[o], time[o] / total) for o in ranked)


def _row(name: str, signature: Signature | None, calls: Sequence[OpCall], steps: int, step_us: float,
         peaks: Peaks | None) -> RooflineRow:
    costed = [c for c in calls if c.cost is not None]
    us = sum(c.self_us for c in costed)
    flops = sum(c.cost.flops for c in costed) / steps  # type: ignore[union-attr]
    moved = sum(c.cost.bytes for c in costed) / steps  # type: ignore[union-attr]
    kind = Counter(c.cost.kind for c in costed).most_common(1)[0][0]  # type: ignore[union-attr]
    dtype = _dtype(costed)
    row = RooflineRow(name, signature, dtype, kind, max(1, round(len(costed) / steps)), us / steps / 1e3,
                      us / step_us if step_us else 0.0, flops, moved, origins=group_origins(calls))
    if peaks is None or row.ms <= 0:
        return row
    peak = peaks.gflops_for(dtype)
    intensity = row.intensity
    roof = min(peak, intensity * peaks.gb_per_s) if not math.isinf(intensity) else peak
    bound = "compute" if intensity >= peaks.ridge(dtype) else "memory"
    fraction = (row.gflops_per_s / roof) if roof > 0 else None
    if bound == "memory" and row.flops == 0:  # a copy: no FLOPs, bandwidth is its only roof
        roof, fraction = 0.0, row.gb_per_s / peaks.gb_per_s
    return replace(row, roof_gflops=roof, bound=bound, roof_fraction=fraction, peak_gb_per_s=peaks.gb_per_s)


def roofline_rows(calls: Sequence[OpCall], peaks: Peaks | None, steps: int = 1, *,
                  by_shape: bool = False, step_us: float | None = None) -> list[RooflineRow]:
    """One row per operator (or per operator and input-shape signature with ``by_shape``) that
    has a cost, by time; times and counts per step. ``step_us`` is the step's summed operator
    self time (the share's 100%), by default that of ``calls``::

        rows = roofline_rows(calls, peaks, steps=2)
        [(r.name, r.bound, r.roof_fraction) for r in rows[:3]]
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    total = step_us if step_us is not None else sum(c.self_us for c in calls) / steps
    groups: dict[tuple, list[OpCall]] = defaultdict(list)
    for c in calls:
        groups[(c.name, c.shapes) if by_shape else (c.name, None)].append(c)
    rows = [_row(name, sig, group, steps, total * steps, peaks) for (name, sig), group in groups.items()
            if any(c.cost is not None for c in group)]
    rows.sort(key=lambda r: r.ms, reverse=True)
    return rows


def plot_roofline(rows: Sequence[RooflineRow], peaks: Peaks, path: str | os.PathLike = "roofline.png", *,
                  top_k: int = 12, title: str = "Roofline") -> str | None:
    """The operators as points (intensity, achieved GFLOP/s; marker size by time) under the
    two roofs of ``peaks`` (one compute roof per dtype). Returns the path, or None without
    matplotlib::

        plot_roofline(rows, peaks, "prof/roofline.png")
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    except ImportError:
        log.info("matplotlib is not installed: chart %s skipped (pip install matplotlib)", path)
        return None
    points = [r for r in rows if r.ms > 0 and r.flops > 0 and r.bytes > 0][:top_k]
    fig = Figure(figsize=(9, 6))
    ax = fig.subplots()
    intensities = [r.intensity for r in points] or [1.0]
    lo = min(min(intensities) / 4, 0.05)
    hi = max(max(intensities) * 4, peaks.ridge() * 8)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for dtype, peak in peaks.gflops.items():
        ax.plot(xs, [min(peak, x * peaks.gb_per_s) for x in xs], label=f"roof {dtype} ({peak:,.0f} GFLOP/s, "
                f"{peaks.gb_per_s:,.0f} GB/s)")
    total = sum(r.ms for r in points) or 1.0
    for r in points:
        ax.scatter([r.intensity], [r.gflops_per_s], s=30 + 600 * r.ms / total, alpha=0.6)
        label = r.name.split("::")[-1] + (f" {r.origins[0][0].where}" if r.origins else "")
        ax.annotate(label, (r.intensity, r.gflops_per_s), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte, bytes a lower bound)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"{title}: {peaks.device}")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.text(0.01, 0.01, peaks.source, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)
