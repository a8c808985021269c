"""Peak memory of one step, and memory as an objective of the gate.

The peak of a variant is the bytes allocated during one run of it above those live when it
began. Where the device's allocator keeps statistics (CUDA; torch_npu's ``torch.npu``, which
documents the same ``memory_allocated``/``reset_peak_memory_stats``/``max_memory_allocated``)
they are read; on CPU the profiler's memory events (``profile_memory=True``) are summed in time
order. Both give the same quantity, so the figures compare across devices::

    peak = peak_bytes(step, backend)                 # int, or None where nothing tells
    t = memory_timeline(step, backend)               # live bytes over the step, top allocators
    keep, reason = decide_memory(m, peak_before, peak_after, slowdown=0.03)
    keep, reason, by = decide_held(keep, reason, speedup, held_before, held_after, sites, floor, 0.03)

A region pass is judged in training on what one site holds for backward instead of a peak
(:func:`decide_held`; the bytes come from ``rewriter.decide.site_gate.held_for_backward``).
``benchmarks/measure.py`` and ``rewriter.profiling`` use :func:`peak_from_events` too, so
there is one implementation. A peak is measured once per candidate, after its timed runs (the
variant is warm), never inside them: the profiler slows what it watches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

OBJECTIVES = ("time", "memory")
# A rewrite "lowers peak memory" when it saves at least this share of the baseline's peak:
# allocator rounding and a few small buffers move a peak by less.
MIN_MEMORY_SAVING = 0.01


def check_objective(objective: Any, memory_slowdown: Any) -> None:
    """Raise a clear error for a bad ``objective=``/``memory_slowdown=`` of optimize()."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be 'time' or 'memory', got {objective!r}")
    if isinstance(memory_slowdown, bool) or not isinstance(memory_slowdown, (int, float)) \
            or not (0.0 <= memory_slowdown < 1.0):
        raise ValueError("memory_slowdown must be a number in [0, 1) (0.03: the step may be up to "
                         f"3% slower when it saves memory), got {memory_slowdown!r}")


def _allocator(device_type: str) -> Any:
    """``torch.cuda`` or ``torch.npu`` when it has allocator statistics, else None."""
    module = getattr(torch, device_type, None) if device_type in ("cuda", "npu") else None
    if module is None or not all(hasattr(module, f) for f in (
            "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")):
        return None
    return module


def peak_from_events(events: Iterable[tuple[int, int]]) -> int:
    """Peak of the running sum of ``(time_ns, bytes)`` allocation events (frees negative),
    above the level at the first event (0 when there is none)."""
    running = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        running += nbytes
        peak = max(peak, running)
    return peak


def memory_events(prof: Any, device_type: str) -> list[tuple[int, int]] | None:
    """``(time_ns, bytes)`` of the profiler's ``[memory]`` events on ``device_type``; None when
    this torch's profiler does not expose them (a private API: degrade to "not available")."""
    try:
        return [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]"
                and str(e.device_type()).rsplit(".", 1)[-1].lower() == device_type]
    except (AttributeError, RuntimeError):
        return None


def _activities(device_type: str) -> list[Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def peak_bytes(run: Callable[[], Any], backend: Any) -> int | None:
    """Bytes allocated during one ``run()`` above those live when it began.

    ``backend``: a rewriter Backend (or anything with ``device_type`` and ``synchronize()``).
    CUDA/NPU: the allocator's own peak statistics (note: this resets the device's peak counter,
    which only ``max_memory_allocated`` readers notice). CPU: the profiler's memory events.
    None when the device tells nothing (an NPU build without the statistics).
    """
    device_type = getattr(backend, "device_type", "cpu")
    sync = getattr(backend, "synchronize", lambda: None)
    module = _allocator(device_type)
    if module is not None:
        sync()
        start = module.memory_allocated()
        module.reset_peak_memory_stats()
        run()
        sync()
        return max(0, module.max_memory_allocated() - start)
    if device_type != "cpu":
        return None
    with torch.profiler.profile(activities=_activities("cpu"), profile_memory=True) as prof:
        run()
    events = memory_events(prof, "cpu")
    return None if events is None else peak_from_events(events)


@dataclass
class MemoryTimeline:
    """Live memory over one step: the curve, its peak and when, and who allocates most."""

    samples: list[tuple[float, int]] = field(default_factory=list)  # (ms from start, live bytes)
    peak_bytes: int = 0
    peak_ms: float = 0.0
    step_ms: float = 0.0
    peak_op: str = ""  # the operator that made the peak allocation
    top_allocators: list[tuple[str, int, int]] = field(default_factory=list)  # (op, bytes, calls)

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20

    def to_dict(self) -> dict:
        return {"peak_mb": round(self.peak_mb, 3), "peak_ms": round(self.peak_ms, 3),
                "step_ms": round(self.step_ms, 3), "peak_op": self.peak_op,
                "top_allocators": [{"op": o, "mb": round(b / 2**20, 3), "calls": c}
                                   for o, b, c in self.top_allocators],
                "samples": [[round(t, 3), b] for t, b in self.samples]}

    def sparkline(self, width: int = 60) -> str:
        """Live memory over the step as one line of block characters (0 to the peak)."""
        if not self.samples or self.peak_bytes <= 0:
            return ""
        blocks = " ▁▂▃▄▅▆▇█"
        span = self.step_ms or (self.samples[-1][0] or 1.0)
        cols = [0] * width
        for t, b in self.samples:  # each column shows the highest level reached in it
            i = min(width - 1, int(width * t / span)) if span > 0 else 0
            cols[i] = max(cols[i], b)
        level = 0
        for i in range(width):  # a column with no event holds the level before it
            level = cols[i] = cols[i] if cols[i] else level
        return "".join(blocks[min(8, max(0, round(8 * c / self.peak_bytes)))] for c in cols)

    def to_markdown(self, title: str = "Memory over the step") -> str:
        lines = [f"### {title}", "",
                 f"peak {self.peak_mb:.2f} MB above the step's start, at {self.peak_ms:.1f} ms of "
                 f"{self.step_ms:.1f} ms" + (f" (in {self.peak_op})" if self.peak_op else ""), ""]
        line = self.sparkline()
        if line:
            lines += ["```", f"{line}  0 .. {self.peak_mb:.1f} MB", "```", ""]
        if self.top_allocators:
            lines += ["| operator | MB allocated | calls |", "|---|---|---|"]
            lines += [f"| {o} | {b / 2**20:.2f} | {c} |" for o, b, c in self.top_allocators]
        return "\n".join(lines)

    def save_chart(self, path: str, title: str = "live memory over one step") -> bool:
        """A PNG of the curve when matplotlib imports (optional); False when it does not."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.step([t for t, _ in self.samples], [b / 2**20 for _, b in self.samples], where="post")
        ax.axvline(self.peak_ms, color="red", linestyle=":", label=f"peak {self.peak_mb:.1f} MB")
        ax.set_xlabel("ms into the step")
        ax.set_ylabel("MB above the start")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return True


def _operator_spans(prof: Any) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of the aten operators the profiler saw."""
    try:
        return [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                for e in prof.profiler.kineto_results.events() if e.name().startswith("aten::")]
    except (AttributeError, RuntimeError):
        return []


def memory_timeline(run: Callable[[], Any], backend: Any, top: int = 8) -> MemoryTimeline | None:
    """Profile one ``run()`` (warm it up first) and return live memory over it, the peak and
    the operators that allocate the most. CPU and CUDA (torch.profiler); None where the
    profiler gives no memory events (NPU: torch_npu's profiler writes operator_memory.csv
    instead, read by ``rewriter.profiling``)."""
    device_type = getattr(backend, "device_type", "cpu")
    if device_type not in ("cpu", "cuda"):
        return None
    with torch.profiler.profile(activities=_activities(device_type), profile_memory=True) as prof:
        run()
    getattr(backend, "synchronize", lambda: None)()
    events = memory_events(prof, device_type)
    if not events:
        return None
    ops = _operator_spans(prof)  # same clock as the memory events (ns)
    t0 = min([s for s, _, _ in ops] + [t for t, _ in events])
    t1 = max([e for _, e, _ in ops] + [t for t, _ in events])
    timeline = MemoryTimeline(step_ms=(t1 - t0) / 1e6)
    running, peak_t = 0, t0
    for t, nbytes in sorted(events):
        running += nbytes
        timeline.samples.append(((t - t0) / 1e6, running))
        if running > timeline.peak_bytes:
            timeline.peak_bytes, peak_t = running, t
    timeline.peak_ms = (peak_t - t0) / 1e6
    # the innermost operator open at the peak made its allocation
    around = [(e - s, n) for s, e, n in ops if s <= peak_t <= e]
    timeline.peak_op = min(around)[1] if around else ""
    by_op: dict[str, list[int]] = {}
    for e in prof.key_averages():
        used = e.self_cpu_memory_usage if device_type == "cpu" else getattr(
            e, "self_device_memory_usage", getattr(e, "self_cuda_memory_usage", 0))
        if e.key.startswith("aten::") and used > 0:
            by_op[e.key] = [used, e.count]
    # positive self usage: what the op allocated and did not free inside itself
    timeline.top_allocators = sorted(((k, v[0], v[1]) for k, v in by_op.items()),
                                     key=lambda x: -x[1])[:top]
    return timeline


def decide_memory(m: Any, before: int | None, after: int | None, slowdown: float,
                  figure: str = "") -> tuple[bool, str]:
    """The memory objective: keep a candidate whose peak is lower (by at least
    ``MIN_MEMORY_SAVING`` of the baseline's) while its median speedup ``m.speedup`` (a
    rewriter.decide.gate Measurement) is at least ``1 / (1 + slowdown)``, i.e. at most ``slowdown``
    slower. ``figure``: the time measurement in words, for the reason."""
    if getattr(m, "out_of_time", False):
        return False, "not reached: the time budget ran out"
    if getattr(m, "busy", False):
        return False, "inconclusive: the machine was busy"
    if before is None or after is None:
        return False, "no memory measurement on this device"
    mem = f"peak {before / 2**20:.2f} MB -> {after / 2**20:.2f} MB"
    if before - after < MIN_MEMORY_SAVING * before or after >= before:
        return False, f"saves no memory: {mem}"
    bound = 1.0 / (1.0 + slowdown)
    s = m.speedup
    if not math.isfinite(s):
        return False, f"no time measurement ({mem})"
    saved = 100.0 * (before - after) / before
    if s < bound:
        return False, (f"too slow for the memory objective: {s:.3f}x is beyond the "
                       f"{100 * slowdown:g}% slowdown bound ({mem}; {figure})")
    return True, f"saves memory: {mem} (-{saved:.0f}%), within the {100 * slowdown:g}% slowdown bound: {figure}"


def decide_held(keep: bool, reason: str, speedup: float | None, before: int, after: int,
                sites: int, floor: int, slowdown: float) -> tuple[bool, str, str]:
    """The memory objective for one region signature in training: (keep, reason, the objective
    that decided). ``before``/``after``: bytes one site holds for backward without / with the
    rewrite (rewriter.decide.site_gate.held_for_backward); ``keep``/``reason``: its time verdict;
    ``speedup``: the region's median (None: no usable time measurement, as for a region too
    small to time or one a busy machine spoiled: the time verdict stands); ``floor``: the
    fewest bytes over all ``sites`` that count as a difference at all.

    Kept on memory when a site holds at least ``MIN_MEMORY_SAVING`` less, over its sites at
    least ``floor`` less, and the region is at most ``slowdown`` slower on its own (a region
    is part of a step, so the step is slowed by less); a region faster on time that holds
    more by as much is not kept; otherwise the time verdict stands."""
    held = f"held for backward {before / 2**20:.3f} MB -> {after / 2**20:.3f} MB a site"
    if speedup is None or not math.isfinite(speedup):
        return keep, reason, "time"  # no time figure to bound the slowdown with
    if before - after >= MIN_MEMORY_SAVING * before and (before - after) * sites >= max(floor, 1):
        saved = f"saves memory: {held} (-{100.0 * (before - after) / before:.0f}%)"
        if speedup >= 1.0 / (1.0 + slowdown):
            return True, f"{saved}, within the {100 * slowdown:g}% slowdown bound; on time: {reason}", "memory"
        return False, (f"too slow for the memory objective: {speedup:.3f}x is beyond the "
                       f"{100 * slowdown:g}% slowdown bound ({held}); on time: {reason}"), "memory"
    if keep and after - before > MIN_MEMORY_SAVING * before and (after - before) * sites >= max(floor, 1):
        return False, f"holds more for backward ({held}) although {reason}", "memory"
    return keep, reason, "time"


def mb(nbytes: int | None) -> float | None:
    """Bytes to MB (2**20) for reports, None kept."""
    return None if nbytes is None else round(nbytes / 2**20, 3)


def profile_memory(model: torch.nn.Module, example_inputs: Any, *, training: bool,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   optimizer: torch.optim.Optimizer | None = None,
                   out_dir: str | None = None) -> MemoryTimeline | None:
    """The memory view of one step of ``model`` (the gate's step: forward, or forward, backward
    and ``optimizer.step()``), after one warm-up step; model, optimizer and RNG restored.
    With ``out_dir``: ``memory.json``, ``memory.md`` and, where matplotlib imports,
    ``memory.png``. None where the device's profiler gives no memory events (NPU).

        view = profile_memory(model, {"input_ids": ids, "labels": ids}, training=True,
                              optimizer=opt, out_dir="prof/")
        print(view.to_markdown())
    """
    import json
    import os

    from rewriter.decide.job import Job, model_device, split_inputs
    from rewriter.decide.state import preserved_state
    from rewriter.devices.backends import get_backend

    args, kwargs = split_inputs(example_inputs)
    backend = get_backend(model_device(model))
    job = Job(model, args, kwargs, backend, training, optimizer, loss_fn)
    with preserved_state(model, optimizer, backend.rng_states()) as snapshot:
        step = job.step(model)
        step()
        snapshot.restore()
        view = memory_timeline(step, backend)
    if view is not None and out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "memory.json"), "w") as f:
            json.dump(view.to_dict(), f, indent=2)
        with open(os.path.join(out_dir, "memory.md"), "w") as f:
            f.write(view.to_markdown() + "\n")
        view.save_chart(os.path.join(out_dir, "memory.png"))
    return view
