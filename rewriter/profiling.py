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
* ``record_run(run, device=None, *, settings=ProfileSettings(), label="profile") ->
  RecordedProfile``: the steps profiled now, the tables built at the first ``.result()``.
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
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from rewriter.decide.gate import host_page_faults
from rewriter.devices.backends import Backend, get_backend, import_torch_npu
from rewriter.profile.ascend_tables import result_from_ascend
from rewriter.profile.attribution import is_python_frame
from rewriter.profile.compare import Comparison, OpChange, compare, plot_top_ops
from rewriter.profile.peaks import Peaks, resolve_peaks
from rewriter.profile.result import (
    ProfileResult,
    ProfileSettings,
    format_shapes,
    top_line,
    top_operator_lines,
)
from rewriter.profile.rows import KernelRow, OpRow
from rewriter.profile.torch_tables import result_from_torch, rows_from_key_averages, top_level_ops

log = logging.getLogger(__name__)

__all__ = [
    "OpRow", "KernelRow", "ProfileSettings", "ProfileResult", "OpChange", "Comparison",
    "open_profiler", "profile_run", "record_run", "RecordedProfile", "profile_model", "profile_step",
    "compare", "plot_top_ops", "PeriodicProfiler", "rows_from_key_averages", "top_level_ops",
    "kineto_quiet", "is_python_frame", "format_shapes", "top_line", "top_operator_lines",
]


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
    NPU: from the ``*_ascend_pt`` directory torch_npu's handler has just written). Each cycle is
    kept as the function that builds its result: torch's events stay in the profiler object, so
    :func:`record_run` can build later; torch_npu's files are read at once (they may be in a
    scratch folder that is removed)."""

    def __init__(self, backend: Backend, settings: ProfileSettings, trace_dir: str | None,
                 label: str, peaks: Peaks | None = None, peaks_note: str = "") -> None:
        self.backend, self.settings, self.trace_dir, self.label = backend, settings, trace_dir, label
        self.peaks, self.peaks_note = peaks, peaks_note
        self.results: list[Callable[[], ProfileResult]] = []
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
            result = result_from_ascend(output, self.backend, self.settings, self.label,
                                         self.peaks, self.peaks_note)
            self.results.append(lambda: result)
            return

        args = (prof, self.backend, self.settings, self.label, self.peaks, self.peaks_note)
        files = {"tensorboard": self.trace_dir, "trace": output} if output else {}

        def build() -> ProfileResult:  # the profiler object keeps this cycle's events
            result = result_from_torch(*args)
            result.files.update(files)
            return result
        self.results.append(build)


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
    recorded = _record(run, get_backend(device), settings, out_dir, label, peaks, cache_dir)
    result = recorded.result()
    if out_dir:
        _write_outputs(result, str(out_dir), top_k)
    return result


class RecordedProfile:
    """Profiled steps whose tables are built the first time :meth:`result` is called (then
    kept). Turning a step's profiler events into tables takes longer than profiling the step
    (BERT's training step, 2-core CPU: ~0.8 s against ~0.3 s), so a report nobody reads need
    not pay it. Until then it holds the profiler's events (BERT's step, 4 layers: ~12 MB of
    host memory, `.diag/held_profile_mem.py`); built, only the tables."""

    def __init__(self, build: Callable[[], ProfileResult], page_faults: int | None) -> None:
        self._build: Callable[[], ProfileResult] | None = build
        self._result: ProfileResult | None = None
        self.page_faults = page_faults

    @property
    def built(self) -> bool:
        return self._result is not None

    def __getstate__(self) -> dict:  # pickled with its tables, not the profiler's events
        return {"_result": self.result(), "_build": None, "page_faults": self.page_faults}

    def result(self) -> ProfileResult:
        if self._result is None:
            assert self._build is not None
            self._result, self._build = self._build(), None
            self._result.page_faults = self.page_faults
        return self._result


def record_run(run: Callable[[], Any], device: str | torch.device | Backend | None = None, *,
               settings: ProfileSettings = ProfileSettings(), label: str = "profile",
               peaks: Peaks | str | None = "auto",
               cache_dir: str | os.PathLike | None = None) -> RecordedProfile:
    """:func:`profile_run` without files, its tables built when first asked for::

        recorded = record_run(step, "cpu", label="original")   # the steps run now
        recorded.result().top(3)                                # the tables are built here, once

    On NPU torch_npu writes what the tables come from into a scratch folder: read at once.
    """
    return _record(run, get_backend(device), settings, None, label, peaks, cache_dir)


def _record(run: Callable[[], Any], backend: Backend, settings: ProfileSettings,
            out_dir: str | os.PathLike | None, label: str, peaks: Peaks | str | None,
            cache_dir: str | os.PathLike | None) -> RecordedProfile:
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
        # the least-faulting step: the unrecorded first one is free of the profiler's own buffers
        return RecordedProfile(collector.results[-1], min(faults) if faults else None)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


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
        result = self._collector.results.pop()()  # now: the next cycle replaces the events
        if self.out_dir:
            result.save(os.path.join(self.out_dir, f"step_{self.steps_done}"), self.top_k)
        self.results.append(result)
        log.info("profiled %s: %s", result.label, "; ".join(
            f"{r.name} {100 * r.share:.0f}%" for r in result.top_operators(3)))
        if self.on_result is not None:
            self.on_result(result)

