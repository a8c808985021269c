"""Operator tables from ``torch.profiler``: rows by name and by input shapes, the top-level
operator sequence, the profiled peak memory, and the whole :class:`ProfileResult` of one cycle."""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from rewriter.devices.backends import Backend
from rewriter.profile.attribution import is_python_frame
from rewriter.profile.op_analysis import analyze
from rewriter.profile.opcalls import calls_from_torch
from rewriter.profile.peaks import Peaks
from rewriter.profile.result import ProfileResult, ProfileSettings, analysis_notes, with_analysis
from rewriter.profile.rows import OpRow, Signature
from rewriter.profile.rows import is_operator as _is_operator


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
    return to_rows(raw, steps, shape_raw), to_rows(shape_raw, steps, ())


PYTHON_ROW = "[Python code]"  # with_stack frames' self time (host time between operators)


def to_rows(raw: list[tuple], steps: int, shape_raw: Sequence[tuple]) -> list[OpRow]:
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


def result_from_torch(prof: Any, backend: Backend, settings: ProfileSettings, label: str,
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
        with_analysis(result, analysis_notes(analysis, peaks_note))
    if settings.profile_memory:
        result.peak_memory_mb = _kineto_peak_mb(prof, backend.device_type)
        if result.peak_memory_mb is not None:
            result.notes.append("peak memory: allocations during the profiled steps, above what "
                                "was allocated when recording began")
    return result
