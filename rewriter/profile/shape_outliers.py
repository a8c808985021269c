"""Shape outliers: an operator whose time per FLOP at one input-shape signature is far above
its time per FLOP at its other signatures (the case study's MatMulV2: 0.8 ms usually, 12.4 ms
for [256,1024] x [1024,256]).

    from rewriter.profile.shape_outliers import find_outliers

    shape_rows = roofline_rows(calls, peaks, steps, by_shape=True)
    for o in find_outliers(shape_rows):
        print(o.row.name, o.row.signature, f"{o.ratio:.1f}x")

Rules (:class:`OutlierSettings`): only heavy operators (``min_op_share`` of the step) with FLOPs
and at least two signatures; a
signature is an outlier when its time per FLOP is ``factor`` times the median of the operator's
other signatures, it takes at least ``min_share`` of the step, and it does at least
``min_work`` of the others' median FLOPs per call (a small GEMM is slower per FLOP by nature:
that is not an anomaly). Everything is relative within one profile; nothing here is a time.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from rewriter.profile.roofline import RooflineRow

__all__ = ["OutlierSettings", "Outlier", "find_outliers"]


@dataclass(frozen=True)
class OutlierSettings:
    factor: float = 3.0  # time per FLOP this many times the operator's other shapes
    min_share: float = 0.005  # of the step
    min_work: float = 0.1  # FLOPs per call, relative to the other shapes' median
    min_op_share: float = 0.05  # only heavy operators: this much of the step over all shapes

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError(f"OutlierSettings.factor must be > 1, got {self.factor}")


@dataclass(frozen=True)
class Outlier:
    """A signature ``row`` of an operator, ``ratio`` times slower per FLOP than the median of
    its ``others`` signatures."""

    row: RooflineRow
    ratio: float
    baseline_gflops: float  # the other signatures' median rate
    others: int

    def to_dict(self) -> dict:
        return {"row": self.row.to_dict(), "ratio": round(self.ratio, 3),
                "baseline_gflops_per_s": round(self.baseline_gflops, 3), "others": self.others}


def _per_flop(r: RooflineRow) -> float:
    return r.ms / r.flops  # ms per FLOP; rows here all have FLOPs


def find_outliers(shape_rows: Sequence[RooflineRow], settings: OutlierSettings = OutlierSettings()
                  ) -> list[Outlier]:
    """The outlying signatures among per-shape roofline rows, worst first::

        find_outliers(roofline_rows(calls, peaks, by_shape=True))
    """
    by_op: dict[str, list[RooflineRow]] = {}
    for r in shape_rows:
        if r.flops > 0 and r.ms > 0 and r.calls:
            by_op.setdefault(r.name, []).append(r)
    found = []
    for rows in by_op.values():
        if len(rows) < 2 or sum(r.share for r in rows) < settings.min_op_share:
            continue
        for r in rows:
            others = [o for o in rows if o is not r]
            baseline = statistics.median(_per_flop(o) for o in others)
            work = statistics.median(o.flops / o.calls for o in others)
            ratio = _per_flop(r) / baseline
            if (ratio >= settings.factor and r.share >= settings.min_share
                    and r.flops / r.calls >= settings.min_work * work):
                found.append(Outlier(r, ratio, 1.0 / baseline / 1e6, len(others)))
    return sorted(found, key=lambda o: o.ratio * o.row.share, reverse=True)
