"""A profiled run as data: what to collect (:class:`ProfileSettings`), what came out
(:class:`ProfileResult`: operator and kernel rows, analysis, files), and its lines in words.
Public through :mod:`rewriter.profiling`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Sequence

from rewriter.profile.advisor import advise, findings_to_markdown
from rewriter.profile.compare import plot_top_ops
from rewriter.profile.op_analysis import OpAnalysis
from rewriter.profile.roofline import describe_origins, plot_roofline
from rewriter.profile.rows import NO_MATPLOTLIB, KernelRow, OpRow, Signature, write_table_files
from rewriter.profile.rows import is_operator as _is_operator
from rewriter.profile.rows import table_cell as _cell

NPU_LEVELS = ("Level_none", "Level0", "Level1", "Level2")



@dataclass(frozen=True)
class ProfileSettings:
    """What to collect, and the schedule: ``wait`` idle steps (first-call compilation happens
    there), ``warmup`` steps with the profiler on but discarded, then ``active`` recorded steps.

        ProfileSettings(active=3, with_stack=True)
    """

    wait: int = 1
    warmup: int = 1
    active: int = 2
    record_shapes: bool = True
    profile_memory: bool = True
    # Python stacks: each operator's model line (rewriter.profile.attribution). Adds host overhead
    # and trace size (reference §3.1); profiled times are for reading, never for deciding.
    with_stack: bool = True
    npu_level: str = "Level1"  # Level1 writes the kernel columns the advisor reads (§3.1)

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "active"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ProfileSettings.{name} must be an int >= 0, got {value!r}")
        if self.active < 1:
            raise ValueError(f"ProfileSettings.active must be at least 1, got {self.active}")
        if self.npu_level not in NPU_LEVELS:
            raise ValueError(f"ProfileSettings.npu_level must be one of {NPU_LEVELS}, got {self.npu_level!r}")

    @property
    def steps(self) -> int:
        return self.wait + self.warmup + self.active


@dataclass
class ProfileResult:
    """One profiled run: the full operator table and what the advisor and comparison need.

        result.top(3)                  # the three most expensive operators
        result.to_markdown(top_k=10)   # table, top three, peak memory, advisor findings
    """

    label: str
    device: str
    steps: int  # active (recorded) steps; every time below is per step
    rows: list[OpRow]  # every operator, by self time
    shape_rows: list[OpRow] = field(default_factory=list)  # one per (operator, input shapes)
    kernels: list[KernelRow] = field(default_factory=list)  # NPU only
    sequence: tuple[str, ...] = ()  # top-level operators in time order (aten:: stripped)
    wall_ms: float | None = None  # the step's wall time, where the profiler marked steps
    peak_memory_mb: float | None = None
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    analysis: OpAnalysis | None = None  # roofline, model lines, shape outliers
    # host page faults of the least-faulting step (None: the platform cannot count them)
    page_faults: int | None = None

    @property
    def step_ms(self) -> float:
        """Summed self time of all operators per step (the table's 100%)."""
        return sum(r.self_ms for r in self.rows)

    def top(self, k: int = 10) -> list[OpRow]:
        return self.rows[:k]

    def top_operators(self, k: int = 3) -> list[OpRow]:
        """The top ``k`` operators (``aten::``/``npu::``), leaving out annotations such as
        ``ProfilerStep*`` or ``Optimizer.step#...``."""
        return [r for r in self.rows if _is_operator(r.name)][:k]

    def row(self, name: str) -> OpRow | None:
        return next((r for r in self.rows if r.name == name), None)

    def to_dict(self) -> dict:
        return {"label": self.label, "device": self.device, "steps": self.steps,
                "step_ms": round(self.step_ms, 4), "wall_ms": self.wall_ms,
                "peak_memory_mb": self.peak_memory_mb, "page_faults": self.page_faults,
                "rows": [r.to_dict() for r in self.rows],
                "kernels": [k.to_dict() for k in self.kernels], "files": dict(self.files),
                "notes": list(self.notes),
                "analysis": self.analysis.to_dict() if self.analysis is not None else None}

    def to_markdown(self, top_k: int = 15, advice: bool = True) -> str:
        lines = [f"## Operators: {self.label} ({self.device})", "", _summary_line(self)]
        top3 = self.top_operators(3)
        if top3:
            lines += ["", "Top three:"] + [f"{i}. {top_line(r)}" for i, r in enumerate(top3, 1)]
        lines += ["", "| # | operator | calls | self ms | total ms | share | input shapes |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {i} | {_cell(r.name)} | {r.calls} | {r.self_ms:.3f} | {r.total_ms:.3f} | "
                  f"{100 * r.share:.1f}% | {_cell(format_shapes(r.input_shapes))} |"
                  for i, r in enumerate(self.top(top_k), 1)]
        if self.analysis is not None:
            lines += ["", self.analysis.to_markdown(min(top_k, 10))]
            if "roofline" not in self.files:
                lines.append(f"- roofline chart: {self.analysis.chart_text()}")
        if advice:
            lines += ["", findings_to_markdown(advise(self))]
        if any(r.name == "ProfilerStep*" for r in self.top(top_k)):
            lines.append("- note: ProfilerStep*'s self time is host time between operators "
                         "(Python, dispatch, profiler overhead)")
        lines += [f"- note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def save(self, out_dir: str | os.PathLike, top_k: int = 15) -> dict[str, str]:
        """Write ``operators.md``, ``operators.json`` and (with matplotlib) ``top_operators.png``
        and ``roofline.png``."""
        os.makedirs(out_dir, exist_ok=True)
        paths = {"table": os.path.join(out_dir, "operators.md"),
                 "json": os.path.join(out_dir, "operators.json")}
        chart = plot_top_ops(self, path=os.path.join(out_dir, "top_operators.png"), top_k=top_k)
        if chart:
            paths["chart"] = chart
        a = self.analysis
        if a is not None and a.peaks is not None and a.rows:
            roof = plot_roofline(a.rows, a.peaks, os.path.join(out_dir, "roofline.png"), title=self.label)
            if roof:
                paths["roofline"] = roof
        elif not any("chart skipped" in n for n in self.notes):
            self.notes.append(NO_MATPLOTLIB)
        self.files.update(paths)
        return write_table_files(paths, self.to_markdown(top_k), self.to_dict())


def top_line(r: OpRow) -> str:
    """``aten::mm 42.0% (3.20 ms, 4 calls) — `Block.forward` model.py:7 `...`, and its backward;
    compute-bound, 35% of peak compute (...)``: one top operator in words."""
    text = f"`{r.name}` {100 * r.share:.1f}% ({r.self_ms:.2f} ms, {r.calls} calls)"
    if r.origin:
        text += f" — {r.origin}"
    if r.roofline:
        text += f"; {r.roofline}"
    return text


def top_operator_lines(rows: Sequence[OpRow], k: int = 3) -> list[str]:
    """Markdown lines for the top ``k`` operators of a table that carry a model line or a
    roofline verdict (the optimize() report's section under its top-operator table)."""
    top = [r for r in rows if _is_operator(r.name)][:k]
    found = [f"{i}. {top_line(r)}" for i, r in enumerate(top, 1) if r.origin or r.roofline]
    return ["", *found] if found else []


def _summary_line(r: ProfileResult) -> str:
    parts = [f"{r.step_ms:.2f} ms of operator self time per step ({r.steps} profiled step"
             f"{'s' if r.steps != 1 else ''})"]
    if r.wall_ms is not None:
        parts.append(f"step wall time {r.wall_ms:.2f} ms")
    if r.peak_memory_mb is not None:
        parts.append(f"peak memory {r.peak_memory_mb:.2f} MB")
    if r.page_faults is not None:
        parts.append(f"{r.page_faults} host page faults a step")
    return "; ".join(parts) + "."


def format_shapes(signatures: Sequence[Signature], limit: int = 2) -> str:
    """``((8, 64), (64, 48), ())`` -> ``8x64, 64x48, -``; several signatures joined by ``|``."""
    text = [", ".join("x".join(map(str, s)) if s else "-" for s in sig) for sig in signatures[:limit]]
    return " | ".join(text) + (" | ..." if len(signatures) > limit else "")


def with_analysis(result: ProfileResult, analysis: OpAnalysis) -> ProfileResult:
    """``result`` with ``analysis`` attached and its rows naming their model line and roofline
    verdict (NPU kernel rows match ``aten::<type>`` operator rows)."""
    by_name = {r.name: r for r in analysis.rows}

    def detail(row: OpRow) -> OpRow:
        short = row.name.split("::", 1)[-1]
        a = by_name.get(row.name) or by_name.get(short)
        origins = analysis.origins.get(row.name) or analysis.origins.get(short) or ()
        verdict = a.verdict() if a is not None and a.bound else ""
        return replace(row, origin=describe_origins(origins), roofline=verdict)

    result.rows = [detail(r) for r in result.rows]
    result.analysis = analysis
    return result


def analysis_notes(analysis: OpAnalysis, peaks_note: str) -> OpAnalysis:
    if peaks_note:
        analysis.notes.append(peaks_note)
    return analysis
