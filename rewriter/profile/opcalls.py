"""Operator calls, one record each, from a torch profile or a torch_npu profile's CSV files:
what the roofline, the per-shape statistics and the attribution read.

    from rewriter.profile.opcalls import calls_from_torch, calls_from_ascend

    calls = calls_from_torch(prof.events())               # torch.profiler, with record_shapes
    calls = calls_from_ascend("run_ascend_pt/ASCEND_PROFILER_OUTPUT")   # kernel_details.csv ...

Each :class:`OpCall` carries its self time, input shapes and dtypes, its cost
(:mod:`rewriter.profile.opcost`) and its origin (:mod:`rewriter.profile.attribution`). The cost sits where the
work is done: a composite (``aten::relu`` calling ``aten::clamp_min``, ``aten::conv2d`` down to
``aten::mkldnn_convolution``) gives its cost to the operator below it of the same kind, so
nothing is counted twice.
"""
from __future__ import annotations

import csv
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from rewriter.profile.attribution import Origin, backward_origin, origin_from_frames
from rewriter.profile.opcost import OpCost, op_cost

__all__ = ["OpCall", "calls_from_torch", "calls_from_ascend", "parse_npu_shapes"]

Shape = tuple[int, ...]
Signature = tuple[Shape, ...]


@dataclass(frozen=True)
class OpCall:
    """One call of an operator (or NPU kernel): ``self_us`` its own time (device time where
    the profile has a device), its input ``shapes`` and ``dtypes``, ``cost`` (None: no rule,
    or counted in the operator it calls) and ``origin`` (None without stacks)."""

    name: str
    self_us: float
    shapes: Signature = ()
    dtypes: tuple[str, ...] = ()
    cost: OpCost | None = None
    origin: Origin | None = None


def _is_op(name: str) -> bool:
    return name.startswith(("aten::", "npu::"))


def _signature(shapes: Any) -> Signature:
    sig = []
    for s in shapes or ():
        ok = isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s)
        sig.append(tuple(s) if ok else ())
    return tuple(sig)


def _self_us(e: Any, device: bool) -> float:
    if device:
        return float(getattr(e, "self_device_time_total", 0.0) or 0.0)
    return float(e.self_cpu_time_total)


def _frames(e: Any) -> list[str]:
    names, p = [], e.cpu_parent
    while p is not None:
        names.append(p.name)
        p = p.cpu_parent
    return names


def _evaluate_function(e: Any) -> Any | None:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("autograd::engine::evaluate_function: "):
            return p
        p = p.cpu_parent
    return None


def calls_from_torch(events: Sequence[Any], *, device_time: bool | None = None) -> list[OpCall]:
    """The operator calls of ``prof.events()`` (torch.profiler's FunctionEvents; any objects
    with ``name``, ``self_cpu_time_total``, ``input_shapes``, ``input_dtypes``,
    ``concrete_inputs``, ``cpu_parent``, ``cpu_children``, ``sequence_nr``, ``fwd_thread``,
    ``thread`` will do). ``device_time``: read device self time (None: when any event has it).

    A backward operator's origin is the forward operator's that has its evaluate_function's
    sequence number (on the forward thread), marked ``backward``."""
    events = list(events)
    if device_time is None:
        device_time = any(getattr(e, "self_device_time_total", 0) for e in events if _is_op(e.name))
    ops = [e for e in events if _is_op(e.name)]
    costs: dict[int, OpCost | None] = {}
    for e in ops:
        costs[id(e)] = op_cost(e.name, _signature(e.input_shapes), tuple(getattr(e, "input_dtypes", None) or ()),
                               tuple(getattr(e, "concrete_inputs", None) or ()))
    kinds_below: dict[int, set[str]] = {}

    def below(e: Any) -> set[str]:
        key = id(e)
        if key not in kinds_below:
            found: set[str] = set()
            for c in getattr(e, "cpu_children", None) or ():
                c_cost = costs.get(id(c))
                if c_cost is not None:
                    found.add(c_cost.kind)
                found |= below(c)
            kinds_below[key] = found
        return kinds_below[key]

    # Forward origins by (sequence number, thread): the outermost operator of each number.
    forward: dict[tuple[int, int], Origin | None] = {}
    origins: dict[int, Origin | None] = {}
    for e in ops:
        ev = _evaluate_function(e)
        if ev is not None:
            continue
        frames = [e.name] + _frames(e)
        origin = origins[id(e)] = origin_from_frames(frames, e.name.split("::", 1)[1])
        seq = getattr(e, "sequence_nr", -1)
        if seq is not None and seq >= 0:
            forward.setdefault((seq, e.thread), origin)
    calls = []
    for e in ops:
        ev = _evaluate_function(e)
        if ev is not None:
            seq, thread = getattr(ev, "sequence_nr", -1), getattr(ev, "fwd_thread", None)
            origin = backward_origin(forward.get((seq, thread)), ev.name.split(": ", 1)[1])
            if origin is None:  # a backward node without a profiled forward: where backward ran
                origin = origin_from_frames([e.name] + _frames(e))
        else:
            origin = origins.get(id(e))
        cost = costs[id(e)]
        if cost is not None and cost.kind in below(e):
            cost = None  # the operator below does this work (and has the time)
        calls.append(OpCall(e.name, _self_us(e, device_time), _signature(e.input_shapes),
                            tuple(getattr(e, "input_dtypes", None) or ()), cost, origin))
    return calls


# --- torch_npu output (reference §3.3) --------------------------------------------------------

def parse_npu_shapes(text: str) -> Signature:
    """``"8,64;64,48;"`` (dims by comma, inputs by semicolon) -> ``((8, 64), (64, 48), ())``."""
    sig = []
    for part in text.strip().strip('"').split(";") if text and text.strip() else ():
        dims = [d.strip() for d in part.split(",") if d.strip()]
        sig.append(tuple(int(d) for d in dims) if all(d.lstrip("-").isdigit() for d in dims) else ())
    return tuple(sig)


def read_csv(path: str) -> list[dict[str, str]]:
    """Rows of a profiler CSV (torch_npu's kernel/operator details); none when it is absent."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def csv_number(value: str | None) -> float:
    """A CSV cell as a number; empty and "N/A" cells count as 0."""
    try:
        return float(value) if value not in (None, "", "N/A") else 0.0
    except ValueError:
        return 0.0


def _stack_frames(text: str) -> list[str]:
    """operator_details.csv's ``Call Stack``: frames innermost first, by ``;`` or new lines."""
    parts = text.replace("\r", "\n").replace(";", "\n").split("\n")
    return [p.strip() for p in parts if p.strip()]


# CANN kernel types -> the aten operators they serve, to borrow those operators' call stacks.
_KERNEL_OPS = {
    "matmul": ("mm", "addmm", "matmul", "linear"), "matmulv2": ("mm", "addmm", "matmul", "linear"),
    "matmulv3": ("mm", "addmm", "matmul", "linear"), "batchmatmul": ("bmm", "baddbmm", "matmul"),
    "batchmatmulv2": ("bmm", "baddbmm", "matmul"), "conv2d": ("convolution", "conv2d"),
    "flashattentionscore": ("npu_fusion_attention",), "softmaxv2": ("_softmax", "softmax"),
}


def _operator_origins(rows: Iterable[dict[str, str]]) -> dict[str, Origin]:
    """The most frequent origin of each operator name in operator_details.csv."""
    seen: dict[str, Counter] = {}
    for r in rows:
        frames = _stack_frames(r.get("Call Stack", ""))
        if not frames:
            continue
        name = r.get("Name", "")
        origin = origin_from_frames(frames, name.split("::", 1)[-1])
        if origin is not None:
            seen.setdefault(name.split("::", 1)[-1], Counter())[origin] += 1
    return {name: c.most_common(1)[0][0] for name, c in seen.items()}


def calls_from_ascend(output_dir: str) -> list[OpCall]:
    """Kernel calls of a torch_npu profile (``ASCEND_PROFILER_OUTPUT``): ``kernel_details.csv``
    gives each kernel's device time, input shapes and dtypes (and output shapes at Level1/2);
    origins come from ``operator_details.csv``'s ``Call Stack`` (filled with ``with_stack``)
    of the operator the kernel serves. Without kernel_details.csv, operator_details.csv's rows
    (host operators, dtypes unknown: fp32 assumed) stand in."""
    op_rows = read_csv(os.path.join(output_dir, "operator_details.csv"))
    origins = _operator_origins(op_rows)
    kernels = read_csv(os.path.join(output_dir, "kernel_details.csv"))
    calls = []
    if kernels:
        for r in kernels:
            kind = r.get("Type") or r.get("Name", "")
            shapes = parse_npu_shapes(r.get("Input Shapes", ""))
            dtypes = tuple(d.strip() for d in r.get("Input Data Types", "").split(";") if d.strip())
            outs = parse_npu_shapes(r.get("Output Shapes", ""))
            names = _KERNEL_OPS.get(kind.lower(), (kind,))
            origin = next((origins[n] for n in names if n in origins), None)
            calls.append(OpCall(kind, csv_number(r.get("Duration(us)")), shapes, dtypes,
                                op_cost(kind, shapes, dtypes, (), outs), origin))
        return calls
    use_device = any(csv_number(r.get("Device Self Duration(us)")) for r in op_rows)
    for r in op_rows:
        name = r.get("Name", "")
        shapes = parse_npu_shapes(r.get("Input Shapes", ""))
        self_us = csv_number(r.get(f"{'Device' if use_device else 'Host'} Self Duration(us)"))
        frames = _stack_frames(r.get("Call Stack", ""))
        origin = origin_from_frames(frames, name.split("::", 1)[-1]) if frames else None
        calls.append(OpCall(name, self_us, shapes, (), op_cost(name, shapes), origin))
    return calls
