"""Profiling: operator tables, Chrome and TensorBoard traces, before/after comparison, charts.

One wrapper over ``torch.profiler`` (CPU, CUDA) and ``torch_npu.profiler`` (NPU, reference
npu_ecosystem.md §3). Usable on its own, in a user's script or training loop::

    from rewriter import profiling

    before = profiling.profile_model(model, (x,), training=True, optimizer=opt,
                                     out_dir="prof/eager")          # -> ProfileResult
    after = profiling.profile_model(fast, (x,), training=True, optimizer=fast_opt,
                                    out_dir="prof/optimized")
    print(before.to_markdown(top_k=10))       # operator table, top three, advisor findings
    cmp = profiling.compare(before, after)     # -> Comparison: vanished/appeared/faster/slower
    cmp.save("prof/compare")                   # comparison.md, comparison.json, before_after.png

    with profiling.PeriodicProfiler(every=500, out_dir="prof/train") as pp:   # long training
        for batch in loader:
            train_step(batch)
            pp.step()                          # profiles 2 steps in every 500

Signatures (all keyword options have defaults):

* ``profile_model(model, example_inputs, *, training, loss_fn=None, optimizer=None, steps=2,
  out_dir=None, top_k=15, device=None, settings=None, label=None) -> ProfileResult``: profiles
  the same step the gate measures (forward; or forward, backward, ``optimizer.step()``), then
  restores the model's parameters, gradients, optimizer state and RNG.
* ``profile_run(run, device=None, *, settings=ProfileSettings(), out_dir=None, label="profile",
  top_k=15) -> ProfileResult``: profiles calls of any ``run()``.
* ``compare(before, after, *, min_change=0.10, min_ms=0.01, labels=None) -> Comparison``.
* ``plot_top_ops(before, after=None, path=..., *, top_k=10, labels=...) -> str | None``: PNG,
  or None without matplotlib (the text tables never need it).
* ``open_profiler(device=None, settings=ProfileSettings(), *, trace_dir=None,
  on_trace_ready=None, repeat=1)``: the configured torch/torch_npu profiler, for your own loop.
* ``profile_step(run, activities, top_k=10) -> list[OpRow]``: one call, its top operators.

With ``out_dir``, ``profile_model``/``profile_run`` write ``trace.json`` (Chrome trace:
chrome://tracing or ui.perfetto.dev), ``tensorboard/<label>/`` (``tensorboard --logdir
<out_dir>/tensorboard`` with the torch-tb-profiler plugin; on NPU the ``*_ascend_pt`` directory
that MindStudio Insight and msprof-analyze open), ``operators.md`` (table and advisor findings),
``operators.json`` and ``top_operators.png`` (with matplotlib).

Times in tables are per profiled step, averaged over the active steps, and include the
profiler's overhead: they show where time goes, they are not the gate's measurements.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from rewriter.devices.backends import Backend, get_backend, import_torch_npu
from rewriter.profile.advisor import advise, findings_to_markdown
from rewriter.profile.attribution import is_python_frame
from rewriter.profile.compare import Comparison, OpChange, compare, plot_top_ops
from rewriter.profile.op_analysis import OpAnalysis, analyze
from rewriter.profile.opcalls import (
    calls_from_ascend,
    calls_from_torch,
    csv_number,
    parse_npu_shapes,
    read_csv,
)
from rewriter.profile.peaks import Peaks, resolve_peaks
from rewriter.profile.roofline import describe_origins, plot_roofline
from rewriter.profile.rows import KernelRow, OpRow, Signature
from rewriter.profile.rows import is_operator as _is_operator
from rewriter.profile.rows import table_cell as _cell

log = logging.getLogger(__name__)

__all__ = [
    "OpRow", "KernelRow", "ProfileSettings", "ProfileResult", "OpChange", "Comparison",
    "open_profiler", "profile_run", "profile_model", "profile_step", "compare", "plot_top_ops",
    "PeriodicProfiler", "rows_from_key_averages", "top_level_ops", "kineto_quiet", "is_python_frame",
]

NPU_LEVELS = ("Level_none", "Level0", "Level1", "Level2")


# --- tables ----------------------------------------------------------------------------------

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
        elif "chart skipped" not in " ".join(self.notes):
            self.notes.append("chart skipped: matplotlib is not installed (pip install matplotlib)")
        self.files.update(paths)
        with open(paths["table"], "w") as f:
            f.write(self.to_markdown(top_k))
        with open(paths["json"], "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return paths


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


# --- building tables from torch.profiler ----------------------------------------------------

def _signature(shapes: Any) -> Signature:
    """torch's ``input_shapes`` (a list per input) as a tuple of int tuples."""
    sig = []
    for s in shapes or ():
        ok = isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s)
        sig.append(tuple(s) if ok else ())  # tensor lists and scalars: no single shape
    return tuple(sig)


def _device_attrs(averages: Sequence[Any]) -> tuple[str, str] | None:
    for self_attr, total_attr in (("self_device_time_total", "device_time_total"),
                                  ("self_cuda_time_total", "cuda_time_total")):
        if any(getattr(e, self_attr, 0) for e in averages):
            return self_attr, total_attr
    return None


def _times_us(e: Any, device: tuple[str, str] | None) -> tuple[float, float]:
    if device:
        return float(getattr(e, device[0], 0.0)), float(getattr(e, device[1], 0.0))
    return float(e.self_cpu_time_total), float(e.cpu_time_total)


def rows_from_key_averages(averages: Sequence[Any], steps: int = 1,
                           shape_averages: Sequence[Any] | None = None) -> tuple[list[OpRow], list[OpRow]]:
    """The operator table (by name) and shape table (by name and input shapes) of a profile.

    ``averages`` is ``prof.key_averages()``, ``shape_averages`` is
    ``prof.key_averages(group_by_input_shape=True)``; any objects with ``key``, ``count``,
    ``self_cpu_time_total``, ``cpu_time_total`` (and ``input_shapes``) will do::

        rows, shape_rows = rows_from_key_averages(prof.key_averages(), steps=2)
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    device = _device_attrs(averages)
    raw = [(e.key, e.count, *_times_us(e, device), ()) for e in averages if not is_python_frame(e.key)]
    frames = [_times_us(e, device) for e in averages if is_python_frame(e.key)]
    if frames:  # with_stack's Python frames: their self time is the Python code's, one row
        raw.append((PYTHON_ROW, 0, sum(f[0] for f in frames), sum(f[0] for f in frames), ()))
    shape_raw = [(e.key, e.count, *_times_us(e, device), (_signature(getattr(e, "input_shapes", None)),))
                 for e in (shape_averages or ()) if not is_python_frame(e.key)]
    return _to_rows(raw, steps, shape_raw), _to_rows(shape_raw, steps, ())


PYTHON_ROW = "[Python code]"  # with_stack frames' self time (host time between operators)


def _to_rows(raw: list[tuple], steps: int, shape_raw: Sequence[tuple]) -> list[OpRow]:
    """(name, count, self_us, total_us, signatures) totals -> per-step OpRows by self time."""
    total = sum(r[2] for r in raw) or 1.0
    shapes: dict[str, list[tuple[float, Signature]]] = {}
    for name, _, self_us, _, sigs in shape_raw:
        if sigs and any(sigs[0]):
            shapes.setdefault(name, []).append((self_us, sigs[0]))
    rows = []
    for name, count, self_us, total_us, sigs in raw:
        top_sigs = sigs or tuple(s for _, s in sorted(shapes.get(name, []), key=lambda x: -x[0])[:3])
        rows.append(OpRow(name, max(1, round(count / steps)) if count else 0, self_us / steps / 1e3,
                          total_us / steps / 1e3, self_us / total, top_sigs))
    rows.sort(key=lambda r: r.self_ms, reverse=True)
    return rows


TimedEvent = tuple[str, float, float, int]  # name, start us, end us, thread


def top_level_ops(events: Iterable[TimedEvent]) -> tuple[str, ...]:
    """Names of the operators not nested in another operator, in time order, prefix stripped.

    The sequence the Ascend advisor matches its affinity patterns against (§4.2): ``matmul``,
    not the ``bmm`` it calls. Annotations (``ProfilerStep#3``, ``Optimizer.step#...``,
    ``autograd::...``) are skipped, so an operator inside one still counts as top level::

        top_level_ops([("aten::matmul", 0, 10, 1), ("aten::bmm", 2, 9, 1)])  # ('matmul',)
    """
    ops = sorted((e for e in events if _is_operator(e[0])), key=lambda e: (e[3], e[1], -e[2]))
    found: list[tuple[float, str]] = []
    thread, open_until = None, -math.inf
    for name, start, end, tid in ops:
        if tid != thread:
            thread, open_until = tid, -math.inf
        if start >= open_until:  # not inside the last top-level operator of this thread
            found.append((start, name.split("::", 1)[1]))
            open_until = end
    found.sort(key=lambda x: x[0])
    return tuple(name for _, name in found)


def _torch_events(prof: Any) -> list[TimedEvent]:
    return [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in prof.events()
            if _is_operator(e.name)]


def _kineto_peak_mb(prof: Any, device_type: str) -> float | None:
    """Peak of the allocations the profiler saw, above what was allocated when it started
    (one implementation: rewriter.decide.memory, also behind optimize()'s memory objective)."""
    from rewriter.decide.memory import memory_events, peak_from_events
    events = memory_events(prof, device_type)
    if not events:
        return None
    return peak_from_events(events) / 2**20


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


def _analysis_notes(analysis: OpAnalysis, peaks_note: str) -> OpAnalysis:
    if peaks_note:
        analysis.notes.append(peaks_note)
    return analysis


def _result_from_torch(prof: Any, backend: Backend, settings: ProfileSettings, label: str,
                       peaks: Peaks | None = None, peaks_note: str = "") -> ProfileResult:
    averages = prof.key_averages()
    shape_averages = prof.key_averages(group_by_input_shape=True) if settings.record_shapes else None
    rows, shape_rows = rows_from_key_averages(averages, settings.active, shape_averages)
    step_row = next((r for r in rows if r.name.startswith("ProfilerStep")), None)
    result = ProfileResult(label, backend.name, settings.active, rows, shape_rows,
                           sequence=top_level_ops(_torch_events(prof)),
                           wall_ms=step_row.total_ms if step_row else None)
    if settings.record_shapes:
        step_us = 1e3 * result.step_ms  # the table's 100%, so shares agree with it
        analysis = analyze(calls_from_torch(prof.events()), peaks, settings.active, step_us=step_us)
        with_analysis(result, _analysis_notes(analysis, peaks_note))
    if settings.profile_memory:
        result.peak_memory_mb = _kineto_peak_mb(prof, backend.device_type)
        if result.peak_memory_mb is not None:
            result.notes.append("peak memory: allocations during the profiled steps, above what "
                                "was allocated when recording began")
    return result


# --- building tables from torch_npu.profiler output (§3.2, §3.3) ----------------------------

_npu_signature = parse_npu_shapes  # ``"8,64;64,48;"`` -> ``((8, 64), (64, 48), ())`` (§3.3)


def _rows_from_operator_details(path: str, steps: int) -> tuple[list[OpRow], list[OpRow]]:
    """operator_details.csv has one line per operator call; aggregate by name, and by shapes."""
    lines = read_csv(path)
    use_device = any(csv_number(r.get("Device Self Duration(us)")) for r in lines)
    kind = "Device" if use_device else "Host"
    by_name: dict[str, list] = {}
    by_shape: dict[tuple[str, str], list] = {}
    for r in lines:
        self_us = csv_number(r.get(f"{kind} Self Duration(us)"))
        total_us = csv_number(r.get(f"{kind} Total Duration(us)"))
        for key, table in ((r["Name"], by_name), ((r["Name"], r.get("Input Shapes", "")), by_shape)):
            acc = table.setdefault(key, [0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + self_us, acc[2] + total_us
    shape_raw = [(n, c, s, t, (_npu_signature(sh),)) for (n, sh), (c, s, t) in by_shape.items()]
    raw = [(n, c, s, t, ()) for n, (c, s, t) in by_name.items()]
    return _to_rows(raw, steps, shape_raw), _to_rows(shape_raw, steps, ())


def _kernels_from_kernel_details(path: str, steps: int) -> list[KernelRow]:
    acc: dict[tuple[str, str, tuple[str, ...]], list] = {}
    for r in read_csv(path):
        dtypes = tuple(d.strip() for d in r.get("Input Data Types", "").split(";") if d.strip())
        a = acc.setdefault((r.get("Type", r.get("Name", "")), r.get("Accelerator Core", ""), dtypes),
                           [0, 0.0, r.get("Input Shapes", "")])
        a[0], a[1] = a[0] + 1, a[1] + csv_number(r.get("Duration(us)"))
    kernels = [KernelRow(t, core, max(1, round(c / steps)), us / steps / 1e3, dt, shapes)
               for (t, core, dt), (c, us, shapes) in acc.items()]
    return sorted(kernels, key=lambda k: k.duration_ms, reverse=True)


def load_trace_events(path: str) -> list[dict]:
    """Events of a Chrome trace file, in either of its two formats (object or bare array)."""
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _timed_events(events: list[dict]) -> list[TimedEvent]:
    """Complete ('X') events; torch_npu writes ``ts`` as a string of epoch microseconds (§3.3),
    too long for a float at ns precision, so it is read as a Decimal relative to the first."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    if not xs:
        return []
    t0 = min(Decimal(str(e["ts"])) for e in xs)
    out = []
    for e in xs:
        start = float(Decimal(str(e["ts"])) - t0)
        out.append((e.get("name", ""), start, start + float(e.get("dur", 0)), hash(e.get("tid"))))
    return out


def _annotation_rows(timed: list[TimedEvent], steps: int) -> tuple[list[OpRow], float | None]:
    """Optimizer annotations (host spans) as rows, and the step's wall time from ProfilerStep#."""
    spans: dict[str, list[float]] = {}
    for name, start, end, _ in timed:
        if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#", "ProfilerStep#")):
            key = "ProfilerStep*" if name.startswith("ProfilerStep#") else name
            spans.setdefault(key, []).append(end - start)
    wall = spans.pop("ProfilerStep*", None)
    rows = [OpRow(n, max(1, round(len(d) / steps)), 0.0, sum(d) / steps / 1e3, 0.0) for n, d in spans.items()]
    return rows, (sum(wall) / steps / 1e3 if wall else None)


def _npu_peak_mb(path: str) -> float | None:
    values = [csv_number(r.get("Allocation Total Allocated(MB)")) for r in read_csv(path)]
    return max(values) if values else None


def _result_from_ascend(root: str, backend: Backend, settings: ProfileSettings, label: str,
                        peaks: Peaks | None = None, peaks_note: str = "") -> ProfileResult:
    """Read a ``*_ascend_pt`` directory's ``ASCEND_PROFILER_OUTPUT`` into a ProfileResult."""
    out = os.path.join(root, "ASCEND_PROFILER_OUTPUT")
    steps = settings.active
    rows, shape_rows = _rows_from_operator_details(os.path.join(out, "operator_details.csv"), steps)
    trace_path = os.path.join(out, "trace_view.json")
    timed = _timed_events(load_trace_events(trace_path)) if os.path.exists(trace_path) else []
    extra, wall = _annotation_rows(timed, steps)
    kernels = _kernels_from_kernel_details(os.path.join(out, "kernel_details.csv"), steps)
    result = ProfileResult(label, backend.name, steps, rows + extra, shape_rows, kernels,
                           sequence=top_level_ops(timed), wall_ms=wall,
                           files={"tensorboard": os.path.dirname(root), "ascend_pt": root})
    if os.path.exists(trace_path):
        result.files["trace"] = trace_path
    if not rows:
        result.notes.append(f"no operator_details.csv rows in {out}")
    calls = calls_from_ascend(out)
    if calls:
        analysis = analyze(calls, peaks, steps)
        if os.path.exists(os.path.join(out, "kernel_details.csv")):
            analysis.notes.append("roofline from kernel_details.csv (device kernels); model lines "
                                  "from operator_details.csv's Call Stack")
        with_analysis(result, _analysis_notes(analysis, peaks_note))
    if settings.profile_memory:
        result.peak_memory_mb = _npu_peak_mb(os.path.join(out, "operator_memory.csv"))
        if result.peak_memory_mb is not None:
            result.notes.append("peak memory: the largest 'Allocation Total Allocated(MB)' "
                                "in operator_memory.csv")
    return result


# --- the profiler wrapper ------------------------------------------------------------------

# Kineto (libkineto's SyncActivityProfilerHandler) logs these at its USDT level each time a
# trace starts and stops, straight to file descriptor 2; KINETO_LOG_LEVEL=6 silences them but
# also kineto's errors, and only if set before the profiler first initialises. So they are
# filtered out of stderr around rewriter's own profiler calls, and every other line passes.
_KINETO_NOISE = re.compile(rb"^USDT:.*\] profiler_(?:start|stop)\s*$")


@contextlib.contextmanager
def kineto_quiet() -> Iterator[None]:
    """Drop kineto's ``USDT: ... profiler_start`` / ``profiler_stop`` lines from stderr (the
    file descriptor: they come from C++) while the block runs; other output is passed on::

        with kineto_quiet():
            prof.step()
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no stderr to guard
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not _KINETO_NOISE.match(line)]
            if kept:
                os.write(2, b"".join(kept))


class _QuietProfiler:
    """A torch/torch_npu profiler whose start, step and stop keep kineto's noise off stderr."""

    def __init__(self, prof: Any) -> None:
        self._prof = prof

    def __getattr__(self, name: str) -> Any:
        return getattr(self._prof, name)

    def start(self) -> None:
        with kineto_quiet():
            self._prof.start()

    def step(self) -> None:
        with kineto_quiet():
            self._prof.step()

    def stop(self) -> None:
        with kineto_quiet():
            self._prof.stop()

    def __enter__(self) -> "_QuietProfiler":
        with kineto_quiet():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        with kineto_quiet():
            return self._prof.__exit__(*exc)


def _chain(*handlers: Callable[[Any], None] | None) -> Callable[[Any], None]:
    def on_trace_ready(prof: Any) -> None:
        for h in handlers:
            if h is not None:
                h(prof)
    return on_trace_ready


def open_profiler(device: str | torch.device | Backend | None = None,
                  settings: ProfileSettings = ProfileSettings(), *, trace_dir: str | None = None,
                  on_trace_ready: Callable[[Any], None] | None = None, repeat: int = 1,
                  skip_first: int = 0) -> Any:
    """The device's profiler, configured: ``torch.profiler.profile`` on CPU/CUDA,
    ``torch_npu.profiler.profile`` with ``_ExperimentalConfig`` on NPU (reference §3.1).

    ``trace_dir`` gets a TensorBoard trace (NPU: the ``*_ascend_pt`` directory) at the end of
    each cycle of ``repeat`` (0: forever) cycles, after ``skip_first`` idle steps;
    ``on_trace_ready(prof)`` runs after it::

        with open_profiler("cpu", ProfileSettings(wait=0, warmup=1, active=2),
                           trace_dir="tb/run") as prof:
            for _ in range(3):
                train_step()
                prof.step()
    """
    backend = get_backend(device)
    if backend.name == "npu":
        return _QuietProfiler(_open_npu_profiler(backend, settings, trace_dir, on_trace_ready, repeat,
                                                 skip_first))
    tb = torch.profiler.tensorboard_trace_handler(trace_dir) if trace_dir else None
    return _QuietProfiler(torch.profiler.profile(
        activities=list(dict.fromkeys(backend.profiler_activities())),
        schedule=torch.profiler.schedule(wait=settings.wait, warmup=settings.warmup,
                                         active=settings.active, repeat=repeat, skip_first=skip_first),
        on_trace_ready=_chain(tb, on_trace_ready), record_shapes=settings.record_shapes,
        profile_memory=settings.profile_memory, with_stack=settings.with_stack))


def _open_npu_profiler(backend: Backend, settings: ProfileSettings, trace_dir: str | None,
                       on_trace_ready: Callable[[Any], None] | None, repeat: int, skip_first: int) -> Any:
    torch_npu = import_torch_npu()
    if torch_npu is None:
        raise RuntimeError("profiling on npu needs torch_npu, which does not import here")
    p = torch_npu.profiler
    level = getattr(p.ProfilerLevel, settings.npu_level)
    # aic_metrics only takes effect at Level1/2; at Level0 torch_npu resets it with a warning (§3.1).
    detailed = settings.npu_level in ("Level1", "Level2")
    metrics = p.AiCMetrics.PipeUtilization if detailed else p.AiCMetrics.AiCoreNone
    config = p._ExperimentalConfig(profiler_level=level, aic_metrics=metrics,
                                   data_simplification=True, export_type=p.ExportType.Text)
    tb = p.tensorboard_trace_handler(trace_dir) if trace_dir else None  # parses synchronously
    return p.profile(activities=list(backend.profiler_activities()),
                     schedule=p.schedule(wait=settings.wait, active=settings.active,
                                         warmup=settings.warmup, repeat=repeat, skip_first=skip_first),
                     on_trace_ready=_chain(tb, on_trace_ready), record_shapes=settings.record_shapes,
                     profile_memory=settings.profile_memory, with_stack=settings.with_stack,
                     experimental_config=config)


class _Collector:
    """Turns each finished profiling cycle into a ProfileResult (torch: from the profiler object;
    NPU: from the ``*_ascend_pt`` directory torch_npu's handler has just written)."""

    def __init__(self, backend: Backend, settings: ProfileSettings, trace_dir: str | None,
                 label: str, peaks: Peaks | None = None, peaks_note: str = "") -> None:
        self.backend, self.settings, self.trace_dir, self.label = backend, settings, trace_dir, label
        self.peaks, self.peaks_note = peaks, peaks_note
        self.results: list[ProfileResult] = []
        self.seen: set[str] = set(self._outputs())

    def _outputs(self) -> list[str]:
        if not self.trace_dir:
            return []
        pattern = "*_ascend_pt" if self.backend.name == "npu" else "*.pt.trace.json"
        return glob.glob(os.path.join(self.trace_dir, pattern))

    def _new_output(self) -> str | None:
        fresh = [p for p in self._outputs() if p not in self.seen]
        self.seen.update(fresh)
        return max(fresh, key=os.path.getmtime) if fresh else None

    def __call__(self, prof: Any) -> None:
        output = self._new_output()
        if self.backend.name == "npu":
            if output is None:
                raise RuntimeError(f"torch_npu wrote no *_ascend_pt directory in {self.trace_dir}")
            result = _result_from_ascend(output, self.backend, self.settings, self.label,
                                         self.peaks, self.peaks_note)
        else:
            result = _result_from_torch(prof, self.backend, self.settings, self.label,
                                        self.peaks, self.peaks_note)
            if output:
                result.files.update(tensorboard=self.trace_dir, trace=output)
        self.results.append(result)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "profile"


def profile_run(run: Callable[[], Any], device: str | torch.device | Backend | None = None, *,
                settings: ProfileSettings = ProfileSettings(), out_dir: str | os.PathLike | None = None,
                label: str = "profile", top_k: int = 15, peaks: Peaks | str | None = "auto",
                cache_dir: str | os.PathLike | None = None) -> ProfileResult:
    """Call ``run()`` ``settings.steps`` times under the profiler; tables from the active steps.

        result = profile_run(lambda: model(x), "cpu", out_dir="prof/")
        result.top(3)
        result.analysis.rows[0].verdict()      # 'compute-bound, 35% of peak compute (...)'

    ``peaks`` for the roofline: ``"auto"`` (this machine's, measured once and cached in
    ``cache_dir``, see :mod:`rewriter.profile.peaks`), a documented device name, a JSON file, a
    :class:`Peaks`, or None (no fractions of peak).
    """
    backend = get_backend(device)
    chosen, peaks_note = _peaks_for(peaks, backend, cache_dir, settings)
    scratch = tempfile.mkdtemp(prefix="rewriter-prof-") if backend.name == "npu" and out_dir is None else None
    trace_dir = os.path.join(out_dir, "tensorboard", _slug(label)) if out_dir else scratch
    try:
        collector = _Collector(backend, settings, trace_dir, label, chosen, peaks_note)
        faults: list[int] = []
        with open_profiler(backend, settings, trace_dir=trace_dir, on_trace_ready=collector) as prof:
            for _ in range(settings.steps):
                before = host_page_faults()
                run()
                backend.synchronize()  # device work belongs to the step that queued it
                after = host_page_faults()
                if before is not None and after is not None:
                    faults.append(after - before)
                prof.step()
        if not collector.results:
            raise RuntimeError("the profiler finished no recording cycle")
        result = collector.results[-1]
        # the least-faulting step: the unrecorded first one is free of the profiler's own buffers
        result.page_faults = min(faults) if faults else None
        if out_dir:
            _write_outputs(result, str(out_dir), top_k)
        return result
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def host_page_faults() -> int | None:
    """This process's minor page faults so far (fresh pages the kernel mapped and zeroed), or
    None where the platform does not count them."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _peaks_for(peaks: Peaks | str | None, backend: Backend, cache_dir: str | os.PathLike | None,
               settings: ProfileSettings) -> tuple[Peaks | None, str]:
    """The roofline's peaks, and a note when there are none; measuring never fails a profile."""
    if not settings.record_shapes or peaks is None:
        return None, ""
    try:
        return resolve_peaks(peaks, backend, cache_dir=cache_dir), ""
    except ValueError:
        raise  # a bad name or file is the caller's mistake
    except Exception as e:  # a device that cannot run the micro-benchmark: roofline without peaks
        log.warning("no peaks for the roofline: %s: %s", type(e).__name__, e)
        return None, f"no peaks for the roofline ({type(e).__name__}: {e})"


def _write_outputs(result: ProfileResult, out_dir: str, top_k: int) -> None:
    trace = result.files.get("trace")
    if trace:
        result.files["trace"] = shutil.copyfile(trace, os.path.join(out_dir, "trace.json"))
    result.save(out_dir, top_k)
    log.info("profile %s written to %s", result.label, out_dir)


def profile_model(model: torch.nn.Module, example_inputs: Any, *, training: bool,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  optimizer: torch.optim.Optimizer | None = None, steps: int = 2,
                  out_dir: str | os.PathLike | None = None, top_k: int = 15,
                  device: str | torch.device | Backend | None = None,
                  settings: ProfileSettings | None = None, label: str | None = None,
                  peaks: Peaks | str | None = "auto",
                  cache_dir: str | os.PathLike | None = None) -> ProfileResult:
    """Profile the step the gate measures: forward (``training=False``, under no_grad), or
    forward, backward and ``optimizer.step()``; restore the model and optimizer afterwards.

        result = profile_model(model, {"input_ids": ids, "labels": ids}, training=True,
                               optimizer=opt, out_dir="prof/eager")

    The loss is ``loss_fn(output)``, else ``output.loss`` (transformers with labels), else a
    fixed random cotangent on the outputs. The model runs in its current train/eval mode.
    ``steps`` recorded steps follow ``settings.wait`` + ``settings.warmup`` unrecorded ones.
    ``peaks`` and ``cache_dir`` as in :func:`profile_run`.
    """
    from rewriter.decide.job import (  # the gate's own step definition
        Job,
        model_device,
        split_inputs,
    )
    from rewriter.decide.state import preserved_state

    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"profile_model expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    args, kwargs = split_inputs(example_inputs)
    backend = get_backend(device if device is not None else model_device(model))
    settings = replace(settings or ProfileSettings(), active=steps)
    original = getattr(model, "original", model)  # an OptimizedModel profiles under its own name
    label = label or f"{type(original).__name__} {'training' if training else 'inference'} step"
    job = Job(model, args, kwargs, backend, training, optimizer, loss_fn)
    with preserved_state(model, optimizer, backend.rng_states()):
        return profile_run(job.step(model), backend, settings=settings, out_dir=out_dir,
                           label=label, top_k=top_k, peaks=peaks, cache_dir=cache_dir)


def profile_step(run: Callable[[], None], activities: list, top_k: int = 10) -> list[OpRow]:
    """Profile one call of ``run`` with torch.profiler and return its top operators by self time.

    The lightweight form the report uses; :func:`profile_run` gives the full result (and the
    NPU path)::

        rows = profile_step(step, [torch.profiler.ProfilerActivity.CPU], top_k=10)
    """
    prof = torch.profiler.profile(activities=list(dict.fromkeys(activities)), record_shapes=True)
    with _QuietProfiler(prof):
        run()
    rows, _ = rows_from_key_averages(prof.key_averages(), 1, prof.key_averages(group_by_input_shape=True))
    return rows[:top_k]


# --- periodic profiling for long training ----------------------------------------------------

class PeriodicProfiler:
    """Profile ``active`` steps in every ``every`` steps of a training loop. Between windows
    the profiler is idle (nothing is recorded), so the cost is paid in the profiled steps only.

        with PeriodicProfiler(every=1000, active=2, out_dir="prof/", on_result=print) as pp:
            for batch in loader:
                train_step(batch)
                pp.step()
        pp.results[-1].top(3)

    Each window gives a ProfileResult (the last ``keep`` are kept in ``results``), written to
    ``out_dir/step_<N>/`` with its trace in ``out_dir/tensorboard/``. A window that ``stop()``
    cuts short is dropped. Shapes and memory are off by default to keep the profiled steps cheap.
    """

    def __init__(self, every: int, *, active: int = 2, warmup: int = 1, skip_first: int = 0,
                 device: str | torch.device | Backend | None = None,
                 out_dir: str | os.PathLike | None = None, top_k: int = 10, keep: int = 20,
                 record_shapes: bool = False, profile_memory: bool = False,
                 on_result: Callable[[ProfileResult], None] | None = None) -> None:
        if not isinstance(every, int) or every < warmup + active:
            raise ValueError(f"every must be an int >= warmup + active ({warmup + active}), got {every!r}")
        if skip_first < 0:
            raise ValueError(f"skip_first must be >= 0, got {skip_first}")
        self.settings = ProfileSettings(wait=every - warmup - active, warmup=warmup, active=active,
                                        record_shapes=record_shapes, profile_memory=profile_memory,
                                        with_stack=False)  # cheap windows: no Python stacks
        self.backend = get_backend(device)
        self.skip_first, self.out_dir, self.top_k, self.on_result = skip_first, out_dir, top_k, on_result
        self.results: deque[ProfileResult] = deque(maxlen=keep)
        self.steps_done = 0
        self._prof: Any = None
        self._scratch: str | None = None
        self._stopping = False

    def start(self) -> "PeriodicProfiler":
        if self._prof is not None:
            raise RuntimeError("PeriodicProfiler is already running")
        if self.out_dir:
            trace_dir = os.path.join(self.out_dir, "tensorboard")
        elif self.backend.name == "npu":  # torch_npu's tables come from files: parse, then drop
            trace_dir = self._scratch = tempfile.mkdtemp(prefix="rewriter-prof-")
        else:
            trace_dir = None
        self._collector = _Collector(self.backend, self.settings, trace_dir, "")
        self._prof = open_profiler(self.backend, self.settings, trace_dir=trace_dir,
                                   on_trace_ready=self._on_trace_ready, repeat=0,
                                   skip_first=self.skip_first)
        self._prof.start()
        return self

    def step(self) -> None:
        """Call once per training step, after it."""
        if self._prof is None:
            raise RuntimeError("PeriodicProfiler.step() before start() (or outside its with block)")
        if self._recording(self.steps_done):
            self.backend.synchronize()  # the step's device work belongs in its window
        self.steps_done += 1
        with warnings.catch_warnings():
            # torch warns that each cycle clears the last one's events: that is the point here.
            warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle")
            self._prof.step()

    def _recording(self, step: int) -> bool:
        """Whether the schedule records (0-based) ``step``: the same arithmetic as torch's."""
        n = step - self.skip_first
        return n >= 0 and n % self.settings.steps >= self.settings.wait + self.settings.warmup

    def stop(self) -> None:
        if self._prof is not None:
            self._stopping = True  # a window cut short by stop() is dropped, not reported
            try:
                self._prof.stop()
            finally:
                self._prof, self._stopping = None, False
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> "PeriodicProfiler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _on_trace_ready(self, prof: Any) -> None:
        if self._stopping:
            log.debug("profiling window cut short by stop() at step %d: dropped", self.steps_done)
            return
        self._collector.label = f"steps {self.steps_done - self.settings.active + 1}-{self.steps_done}"
        self._collector(prof)
        result = self._collector.results.pop()
        if self.out_dir:
            result.save(os.path.join(self.out_dir, f"step_{self.steps_done}"), self.top_k)
        self.results.append(result)
        log.info("profiled %s: %s", result.label, "; ".join(
            f"{r.name} {100 * r.share:.0f}%" for r in result.top_operators(3)))
        if self.on_result is not None:
            self.on_result(result)

