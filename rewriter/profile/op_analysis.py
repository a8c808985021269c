"""One profile's operators analysed as the MatMul case study does by hand: each operator's
roofline (how good is it?), the model line behind it (which line of my model?), and its
per-shape statistics with outliers (which shapes are abnormal?).

    from rewriter.profile.op_analysis import analyze

    analysis = analyze(calls, peaks, steps=2)      # calls: rewriter.profile.opcalls; peaks: rewriter.profile.peaks
    print(analysis.to_markdown())
    analysis.rows[0].origins[0][0].describe()      # "`Block.forward` model.py:7 `y = ...`"

:class:`rewriter.profiling.ProfileResult` carries one as ``analysis``; the advisor reads its
outliers and origins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from rewriter.profile.opcalls import OpCall, Signature
from rewriter.profile.peaks import Peaks
from rewriter.profile.roofline import RooflineRow, describe_origins, group_origins, roofline_rows
from rewriter.profile.shape_outliers import Outlier, OutlierSettings, find_outliers

__all__ = ["OpAnalysis", "analyze"]

HEAVY_OPS = 5  # operators whose shapes are listed
SHAPES_PER_OP = 4


def _shape_text(sig: Signature | None) -> str:
    if not sig:
        return "-"
    return ", ".join("x".join(map(str, s)) if s else "-" for s in sig)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass
class OpAnalysis:
    """Roofline rows per operator (``rows``) and per signature (``shape_rows``), the outlying
    signatures, and the peaks they were measured against (None: roofline fractions left out)."""

    peaks: Peaks | None
    rows: list[RooflineRow]
    shape_rows: list[RooflineRow]
    outliers: list[Outlier]
    attributed: float = 0.0  # share of operator time with an origin
    notes: list[str] = field(default_factory=list)
    origins: dict[str, tuple] = field(default_factory=dict)  # every operator's, with a cost or not

    def row(self, name: str) -> RooflineRow | None:
        return next((r for r in self.rows if r.name == name), None)

    def shape_row(self, name: str, signature: Signature) -> RooflineRow | None:
        return next((r for r in self.shape_rows if r.name == name and r.signature == signature), None)

    def to_dict(self) -> dict:
        return {"peaks": self.peaks.to_dict() if self.peaks else None,
                "rows": [r.to_dict() for r in self.rows],
                "shape_rows": [r.to_dict() for r in self.shape_rows],
                "outliers": [o.to_dict() for o in self.outliers],
                "attributed": round(self.attributed, 4), "notes": list(self.notes)}

    def chart_text(self) -> str:
        """What the roofline chart shows, in words (for when matplotlib is not installed)."""
        if self.peaks is None or not self.rows:
            return "no roofline: no peaks or no operator with a cost"
        parts = [f"{r.name.split('::')[-1]} at {r.intensity:.2f} FLOP/B, {r.verdict()}"
                 for r in self.rows[:5] if r.flops > 0]
        return (f"the roofline chart would place {len(self.rows)} operators under the roofs; ridge "
                f"point {self.peaks.ridge():.1f} FLOP/B (left of it memory-bound): " + "; ".join(parts))

    def to_markdown(self, top_k: int = 10) -> str:
        lines = ["### Roofline", ""]
        if self.peaks is not None:
            lines.append(f"Peaks: {self.peaks.describe()}.")
        else:
            lines.append("Peaks: none (fractions of peak left out).")
        lines += ["Bytes are a lower bound (each tensor read or written once), so GB/s and a "
                  "memory-bound fraction are lower bounds too.", "",
                  "| # | operator | share | calls | GFLOP/s | GB/s | FLOP/B | bound, of roof | where |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(self.rows[:top_k], 1):
            of_roof = (f"{r.bound}, {100 * r.roof_fraction:.0f}%" if r.bound and r.roof_fraction is not None
                       else "-")
            intensity = "-" if math.isinf(r.intensity) else f"{r.intensity:.2f}"
            lines.append(f"| {i} | {_cell(r.name)} | {100 * r.share:.1f}% | {r.calls} | "
                         f"{r.gflops_per_s:,.2f} | {r.gb_per_s:,.2f} | {intensity} | {of_roof} | "
                         f"{_cell(describe_origins(r.origins)) or '-'} |")
        heavy = [r.name for r in self.rows[:HEAVY_OPS]]
        lines += ["", "### Per shape (heavy operators)", "",
                  "| operator | input shapes | calls | us/call | GFLOP/s | bound, of roof | where |",
                  "|---|---|---|---|---|---|---|"]
        for name in heavy:
            for r in [s for s in self.shape_rows if s.name == name][:SHAPES_PER_OP]:
                of_roof = (f"{r.bound}, {100 * r.roof_fraction:.0f}%" if r.bound and r.roof_fraction is not None
                           else "-")
                lines.append(f"| {_cell(name)} | {_cell(_shape_text(r.signature))} | {r.calls} | "
                             f"{r.us_per_call:,.1f} | {r.gflops_per_s:,.2f} | {of_roof} | "
                             f"{_cell(describe_origins(r.origins)) or '-'} |")
        if self.outliers:
            lines += ["", "Shape outliers (time per FLOP far above the operator's other shapes):"]
            lines += [f"- `{o.row.name}` at {_shape_text(o.row.signature)}: {o.ratio:.1f}x the time per "
                      f"FLOP of its {o.others} other shape(s) ({o.row.gflops_per_s:,.2f} vs "
                      f"{o.baseline_gflops:,.2f} GFLOP/s), {100 * o.row.share:.1f}% of the step; "
                      f"{describe_origins(o.row.origins) or 'origin unknown'}" for o in self.outliers]
        else:
            lines += ["", "No shape outlier: each heavy operator's time per FLOP is alike across its shapes."]
        if self.attributed < 0.5:
            lines.append(f"- note: only {100 * self.attributed:.0f}% of operator time has a model line "
                         "(profile with with_stack=True for stacks)")
        lines += [f"- note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def analyze(calls: Sequence[OpCall], peaks: Peaks | None, steps: int = 1, *,
            outliers: OutlierSettings = OutlierSettings(), step_us: float | None = None) -> OpAnalysis:
    """Roofline per operator and per signature, outliers and attribution coverage of ``calls``
    (per step, over ``steps`` profiled steps)::

        analysis = analyze(calls_from_torch(prof.events()), device_peaks("cpu"), steps=2)
    """
    rows = roofline_rows(calls, peaks, steps, step_us=step_us)
    shape_rows = roofline_rows(calls, peaks, steps, by_shape=True, step_us=step_us)
    total = sum(c.self_us for c in calls) or 1.0
    attributed = sum(c.self_us for c in calls if c.origin is not None) / total
    by_name: dict[str, list[OpCall]] = {}
    for c in calls:
        by_name.setdefault(c.name, []).append(c)
    origins = {name: group_origins(group) for name, group in by_name.items()}
    return OpAnalysis(peaks, rows, shape_rows, find_outliers(shape_rows, outliers), attributed,
                      origins={n: o for n, o in origins.items() if o})
