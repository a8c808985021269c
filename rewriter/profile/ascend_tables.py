"""Operator and kernel tables from a torch_npu profile's ``ASCEND_PROFILER_OUTPUT`` (reference
npu_ecosystem.md §3.2, §3.3): operator_details.csv, kernel_details.csv, trace_view.json and
operator_memory.csv, into the same :class:`ProfileResult` as a torch profile."""
from __future__ import annotations

import json
import os
from decimal import Decimal

from rewriter.devices.backends import Backend
from rewriter.profile.op_analysis import analyze
from rewriter.profile.opcalls import calls_from_ascend, csv_number, parse_npu_shapes, read_csv
from rewriter.profile.peaks import Peaks
from rewriter.profile.result import ProfileResult, ProfileSettings, analysis_notes, with_analysis
from rewriter.profile.rows import KernelRow, OpRow
from rewriter.profile.torch_tables import TimedEvent, to_rows, top_level_ops

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
    return to_rows(raw, steps, shape_raw), to_rows(shape_raw, steps, ())


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


def result_from_ascend(root: str, backend: Backend, settings: ProfileSettings, label: str,
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
        with_analysis(result, analysis_notes(analysis, peaks_note))
    if settings.profile_memory:
        result.peak_memory_mb = _npu_peak_mb(os.path.join(out, "operator_memory.csv"))
        if result.peak_memory_mb is not None:
            result.notes.append("peak memory: the largest 'Allocation Total Allocated(MB)' "
                                "in operator_memory.csv")
    return result
