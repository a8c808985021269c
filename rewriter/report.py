"""What optimize() decided and why, readable by a person (Markdown) and by programs (JSON).

    print(model.report)                 # Markdown
    model.report.decisions[0].kept      # per pass tried
    model.report.save("out/")           # report.json, report.md, plan.json
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from rewriter.profile.advisor import Finding, advise, findings_to_markdown
from rewriter.profiling import (
    Comparison,
    OpRow,
    RecordedProfile,
    compare,
    format_shapes,
    top_operator_lines,
)

# Report attributes built from the step's profiles; read first, they are built then
_FROM_PROFILES = frozenset({"top_ops_before", "top_ops_after", "findings_before", "findings_after",
                            "op_comparison", "_profiles"})


@dataclass
class Decision:
    """One pass tried: kept or not, with the measurement and the reason in words."""

    pass_name: str
    kept: bool
    # kept | rejected | no sites | not applicable | failed verification | raised | replayed | reverted |
    # superseded (the original model compiled runs instead) | not reached (the time budget) | not tried
    # (a compile not paid; a pass not measured beside a compile decided first, decide.compile_first)
    status: str
    reason: str
    speedup: float | None = None
    noise: float | None = None
    max_abs_error: float | None = None
    sites: list[str] = field(default_factory=list)
    measurement: dict | None = None
    verification: str = ""  # how the numerics check passed (error, and any yardstick used)
    scope: str = "site"  # "site": decided per region signature; "step": on the whole step
    # Per region signature: sites, region ms before -> after ± noise, calls per step, the
    # predicted step saving, verification error, and where the decision came from.
    regions: list[dict] = field(default_factory=list)
    objective: str | None = None  # the objective that decided: "time" | "memory" (None: not measured)
    peak_mb_before: float | None = None  # peak MB of one step above its start, without / with it
    peak_mb_after: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Report:
    model: str
    device: str
    mode: str  # "inference" | "training"
    dtype: str | None
    front_end: str = ""
    front_end_reason: str = ""
    graphs: int = 0
    decisions: list[Decision] = field(default_factory=list)
    final: dict = field(default_factory=dict)  # whole-model check: kept, speedup, noise, reason
    optimize_seconds: float = 0.0
    phases: dict = field(default_factory=dict)  # seconds per phase: capture, record, verify, ...
    top_ops_before: list[OpRow] = field(default_factory=list)
    top_ops_after: list[OpRow] = field(default_factory=list)
    findings_before: list[Finding] = field(default_factory=list)
    findings_after: list[Finding] = field(default_factory=list)
    op_comparison: Comparison | None = None
    left_as_modules: list[str] = field(default_factory=list)
    plan_status: str = ""
    notes: list[str] = field(default_factory=list)
    plan: dict | None = None
    objective: str = "time"  # optimize(objective=)
    # The memory view (rewriter.decide.memory.MemoryTimeline.to_dict() of one step, "before"/"after")
    memory: dict = field(default_factory=dict)
    # Regional rewriting: per block class, its instances, the graphs that run for it, the kept
    # passes that rewrite them (rewriter.capture.front_ends.RegionalCapture.block_rows)
    blocks: list[dict] = field(default_factory=list)
    # What one measured step is, where it is not one call (a generation: prefill + decode calls)
    workload: str = ""

    def __getattribute__(self, name: str) -> Any:
        if name in _FROM_PROFILES:  # the first read builds the tables (profiles_later)
            object.__getattribute__(self, "_build_pending_tables")()
        return object.__getattribute__(self, name)

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of the optimized model) or deep-copied: with its tables,
        built now if still pending, never the profiler's events."""
        self._build_pending_tables()
        return dict(self.__dict__)

    def _build_pending_tables(self) -> None:
        pending = self.__dict__.pop("_pending_profiles", None)
        if pending is not None:
            self._tables_from(*pending)

    def profiles_later(self, original: RecordedProfile, optimized: RecordedProfile | None = None) -> None:
        """The operator tables, advisor findings and comparison come from these recorded
        profiles, built when one of them is first read (``print(report)``, ``to_dict()``,
        ``save()``, ``report.top_ops_before``...): optimize() does not wait for tables nobody
        reads. A failure to build them becomes a note, as a failure to profile does."""
        self.__dict__["_pending_profiles"] = (original, optimized)

    def _tables_from(self, original: RecordedProfile, optimized: RecordedProfile | None) -> None:
        try:
            before = original.result()
            self.top_ops_before, self.findings_before = before.top(10), advise(before)
            self.attach_profiles(original=before)
            if optimized is not None:
                after = optimized.result()
                self.top_ops_after, self.findings_after = after.top(10), advise(after)
                self.op_comparison = compare(before, after, labels=("original", "optimized"))
                self.attach_profiles(original=before, optimized=after)
        except Exception as e:  # a profiler problem must not cost the user the report
            self.notes.append(f"profiling failed: {type(e).__name__}: {e}")

    def attach_profiles(self, **profiles: Any) -> None:
        """The ProfileResults the report's tables came from (``original=``, ``optimized=``):
        :meth:`save` writes each one's tables and charts (the roofline among them). Not part of
        :meth:`to_dict`: the tables above are."""
        self._profiles = {label: p for label, p in profiles.items() if p is not None}

    @property
    def kept_passes(self) -> list[str]:
        """Passes whose rewrites the returned model runs."""
        if not self.final.get("kept", True):
            return []
        return [d.pass_name for d in self.decisions if d.kept]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["top_ops_before"] = [r.to_dict() for r in self.top_ops_before]
        d["top_ops_after"] = [r.to_dict() for r in self.top_ops_after]
        d["findings_before"] = [f.to_dict() for f in self.findings_before]
        d["findings_after"] = [f.to_dict() for f in self.findings_after]
        d["op_comparison"] = self.op_comparison.to_dict() if self.op_comparison else None
        d["kept_passes"] = self.kept_passes
        d.pop("plan")
        return _json_safe(d)

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``report.json``, ``report.md`` and ``plan.json`` into ``directory``."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "report.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        with open(os.path.join(directory, "report.md"), "w") as f:
            f.write(self.to_markdown())
        if self.plan is not None:
            with open(os.path.join(directory, "plan.json"), "w") as f:
                json.dump(self.plan, f, indent=2)
        if self.op_comparison is not None:  # comparison.md/json and, with matplotlib, a chart
            self.op_comparison.save(os.path.join(directory, "profile"))
        for label, profile in getattr(self, "_profiles", {}).items():
            # operators.md/json; with matplotlib, top_operators.png and roofline.png
            profile.save(os.path.join(directory, "profile", label))
        if self.memory:  # the live-memory curve as a PNG where matplotlib imports (optional)
            from rewriter.decide.memory import MemoryTimeline
            for label, view in self.memory.items():
                t = MemoryTimeline(samples=[(x, y) for x, y in view.get("samples", [])],
                                   peak_bytes=int(view["peak_mb"] * 2**20), peak_ms=view["peak_ms"],
                                   step_ms=view["step_ms"])
                t.save_chart(os.path.join(directory, f"memory_{label}.png"),
                             f"live memory over one step, {label}")

    def to_markdown(self) -> str:
        lines = [f"# rewriter report: {self.model}", "",
                 f"- device: {self.device}; mode: {self.mode}; dtype: {self.dtype or 'fp32 numerics (no precision lowering)'}",
                 f"- front-end: {self.front_end or 'none'} ({self.front_end_reason}); graphs: {self.graphs}",
                 f"- time spent optimizing: {self.optimize_seconds:.1f} s"]
        if self.workload:
            lines.append(f"- step: {self.workload}")
        if self.plan_status:
            lines.append(f"- plan: {self.plan_status}")
        if self.final:
            verdict = "optimized model returned" if self.final.get("kept") else "original model returned"
            lines.append(f"- whole model: {verdict}: {self.final.get('reason', '')}")
        if self.blocks:
            lines += ["", "## Blocks (each class decided once, installed in every instance)", "",
                      "| block | instances | modules | graphs (nodes) | kept passes that rewrite it |",
                      "|---|---|---|---|---|"]
            for b in self.blocks:
                graphs = ", ".join(f"{g} ({n})" for g, n in zip(b["graphs"], b["nodes"])) or "-"
                calls = b.get("calls", b["instances"])  # one instance called again: ALBERT
                count = f"{b['instances']} ({calls} calls)" if calls != b["instances"] else f"{b['instances']}"
                lines.append(f"| {b['class']} | {count} | {b['first']} .. {b['last']} | "
                             f"{graphs} | {', '.join(b.get('passes', [])) or 'none'} |")
        lines += ["", "| pass | decision | speedup | max abs error | sites | reason |",
                  "|---|---|---|---|---|---|"]
        for d in self.decisions:
            speed = f"{d.speedup:.3f}x ±{d.noise:.3f}" if d.speedup is not None and d.noise is not None else "-"
            err = f"{d.max_abs_error:.1e}" if d.max_abs_error is not None else "-"
            lines.append(f"| {d.pass_name} | {d.status} | {speed} | {err} | {len(d.sites)} | {_cell(d.reason)} |")
        regions = [(d, row) for d in self.decisions for row in d.regions]
        if regions:
            lines += ["", "## Regions (one row per signature: identical sites are measured once)", "",
                      "| pass | signature | sites | example | ran in | region ms before -> after | "
                      "speedup | predicted step saving | error | from | decision |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for d, row in regions:
                lines.append(_region_row(d.pass_name, row))
        if self.final.get("predicted_saving_ms") is not None:
            lines += ["", f"Whole step, original vs composed: {_cell(self.final.get('reason', ''))}"]
        lines += _memory_lines(self)
        if self.phases:
            other = (self.optimize_seconds or 0.0) - sum(self.phases.values())
            spent = ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())
            lines += ["", "time per phase: " + spent + (f", other {other:.1f} s" if other >= 0.05 else "")]
        for title, rows in (("Top operators before", self.top_ops_before),
                            ("Top operators after", self.top_ops_after)):
            if rows:
                lines += ["", f"## {title}", "", "| operator | calls | self ms | share | input shapes |",
                          "|---|---|---|---|---|"]
                lines += [f"| {r.name} | {r.calls} | {r.self_ms:.2f} | {100 * r.share:.1f}% | "
                          f"{_cell(format_shapes(r.input_shapes))} |" for r in rows]
                lines += top_operator_lines(rows)  # model line and roofline of the top three
        for title, found in (("Advisor, before", self.findings_before), ("Advisor, after", self.findings_after)):
            if found:
                lines += ["", f"## {title}", "", findings_to_markdown(found)]
        if self.op_comparison is not None:
            lines += ["", self.op_comparison.to_markdown(10)]
        sited = [d for d in self.decisions if d.sites]
        if sited:
            lines += ["", "## Sites", ""]
            for d in sited:
                lines.append(f"- {d.pass_name}: " + "; ".join(d.sites[:8]) + (" ..." if len(d.sites) > 8 else ""))
        if self.left_as_modules:
            lines += ["", f"Modules left as calls (no functional form): {', '.join(self.left_as_modules[:10])}"]
        for note in self.notes:
            lines.append(f"- note: {note}")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_markdown()


def _memory_lines(report: "Report") -> list[str]:
    """Per decision: peak memory without -> with the rewrite and the objective that decided;
    the step before/after: live memory over the step, its peak and the top allocators."""
    from rewriter.decide.memory import MemoryTimeline
    rows = [d for d in report.decisions if d.peak_mb_before is not None
            or (report.objective != "time" and d.objective is not None)]
    lines: list[str] = []
    if rows or report.memory or report.objective != "time":
        lines += ["", f"## Memory (objective: {report.objective})", ""]
    if rows:
        lines += ["| pass | decided by | peak MB without -> with | saved | decision |", "|---|---|---|---|---|"]
        for d in rows:
            a, b = d.peak_mb_before, d.peak_mb_after
            held = ""
            if a is None and (sums := held_mb(d.regions)) is not None:
                (a, b), held = sums, " held for backward"  # region passes: summed over their sites
            peak = f"{a:.2f} -> {b:.2f}{held}" if a is not None and b is not None else "-"
            saved = f"{a - b:.2f} MB ({100 * (a - b) / a:.0f}%)" if a and b is not None else "-"
            lines.append(f"| {d.pass_name} | {d.objective or '-'} | {peak} | {saved} | {d.status} |")
    for label in ("before", "after"):
        view = report.memory.get(label)
        if view:
            t = MemoryTimeline(samples=[(x, y) for x, y in view.get("samples", [])],
                               peak_bytes=int(view["peak_mb"] * 2**20), peak_ms=view["peak_ms"],
                               step_ms=view["step_ms"], peak_op=view.get("peak_op", ""),
                               top_allocators=[(r["op"], int(r["mb"] * 2**20), r["calls"])
                                               for r in view.get("top_allocators", [])])
            lines += ["", t.to_markdown(f"Memory over the step, {label}")]
    return lines


def held_mb(rows: list[dict] | None) -> tuple[float, float] | None:
    """MB held for backward without / with a region pass at every site, over all its
    signatures, kept or not (as a step pass's row shows its candidate's peak): what the rewrite
    would change, which is why it was or was not kept (objective="memory" in training; None
    where no signature was measured so)."""
    held = [r for r in rows or () if r.get("held_bytes_before") is not None]
    if not held:
        return None
    return (sum(r["held_bytes_before"] * r.get("sites", 1) for r in held) / 2**20,
            sum(r["held_bytes_after"] * r.get("sites", 1) for r in held) / 2**20)


def _region_row(pass_name: str, row: dict) -> str:
    def num(key: str, fmt: str) -> str:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"
    speed = (f"{num('speedup', '.3f')}x ±{num('noise', '.3f')}" if row.get("speedup") is not None else "-")
    times = (f"{num('region_ms_before', '.3f')} -> {num('region_ms_after', '.3f')}"
             if row.get("region_ms_before") is not None else "-")
    saving = f"{num('saved_ms_per_step', '.3f')} ms" if row.get("saved_ms_per_step") is not None else "-"
    sites = f"{row.get('sites', 0)} site" + ("s" if row.get("sites", 0) != 1 else "")
    return (f"| {pass_name} | {row.get('signature', '')[:8]} | {sites} | {_cell(str(row.get('example', '')))[:60]} "
            f"| {row.get('ran_in', '-')} | {times} | {speed} | {saving} | {num('max_abs_error', '.1e')} "
            f"| {row.get('source', '-')} | {row.get('status', '')}: {_cell(str(row.get('reason', '')))} |")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
