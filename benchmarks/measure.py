"""What a row reports besides its name: side-by-side timing, peak memory, numerics, the machine.

    m = side_by_side(eager_step, config_step, BENCH_GATE)   # rewriter.decide.gate.measure, interleaved
    m.speedup, m.noise, m.candidate_ms
    peak_memory_mb(config_step)     # torch.profiler memory events, one step
    relative_error(out, reference)  # max |out - ref| / max |ref|

Timing is the gate's own loop (``rewriter.decide.gate.measure``): eager and the configuration run
interleaved (A B, B A, ...) after warm-up in this process, and the speedup is the median of
the paired ratios, so drift in clock speed or machine load hits both alike.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import tempfile
from typing import Any, Callable

import torch

from rewriter.decide.gate import GateSettings, Measurement, Step, WallClock, measure
from rewriter.devices.cpu_identity import cpu_info

# Default run: at least 10 pairs; stop once the speedup is clear of 1 by two noise widths or
# 5 s of pairs have run (at most 30 pairs).
BENCH_GATE = GateSettings(warmup=2, warmup_seconds=0.5, max_warmup=10, min_pairs=10,
                          max_pairs=30, budget_seconds=5.0)
# The quick smoke run keeps every sample (three pairs leave nothing to flag outliers against).
QUICK_GATE = GateSettings(warmup=1, warmup_seconds=0.0, max_warmup=1, min_pairs=3, max_pairs=3,
                          budget_seconds=0.5, outlier_factor=float("inf"))

MEMORY_METHOD = ("peak of the bytes allocated during one step above those live when it began "
                 "(rewriter.decide.memory.peak_bytes: torch.profiler memory events on CPU, allocator statistics on CUDA/NPU): "
                 "activations, gradients and workspace; not the weights or optimizer state")


def side_by_side(eager: Callable[[], Any], config: Callable[[], Any],
                 settings: GateSettings) -> Measurement:
    """Eager (baseline) against a configuration, interleaved, in this process."""
    return measure(Step(_discard(eager), (), "eager"), Step(_discard(config), (), "config"),
                   clock=WallClock(), settings=settings)


def step_faults(m: Measurement) -> dict[str, float] | None:
    """Median host page faults a step, eager's and the configuration's (None where the host
    does not count them): a step that maps fresh memory every time pays for each page, and how
    often it does depends on the allocator's state in this process, not only on the model."""
    if not m.baseline_faults or not m.candidate_faults:
        return None
    return {"eager": statistics.median(m.baseline_faults),
            "config": statistics.median(m.candidate_faults)}


def _discard(step: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        step()
    return run


def spread_ms(times: list[float]) -> float | None:
    """Interquartile range of step times, in ms."""
    if len(times) < 2:
        return None
    q1, _, q3 = statistics.quantiles(times, n=4)
    return 1e3 * (q3 - q1)


def peak_memory_mb(step: Callable[[], Any], device: str = "cpu") -> float | None:
    """Peak MB allocated during one step (after one unmeasured warm-up step), as optimize()'s
    memory objective measures it (rewriter.decide.memory.peak_bytes: allocator statistics on
    CUDA/NPU, profiler memory events on CPU)."""
    from rewriter.decide.memory import mb, peak_bytes
    from rewriter.devices.backends import get_backend
    step()
    return mb(peak_bytes(step, get_backend(device)))


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor to compare: transformers' ``logits``, else the output or its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"no output tensor to compare in a {type(out).__name__}")


def relative_error(out: Any, reference: torch.Tensor) -> float:
    """``max |out - reference| / max |reference|``: bf16 shows ~1e-2, fp32 rewrites ~1e-6."""
    got = output_tensor(out).detach().float()
    want = reference.detach().float()
    if got.shape != want.shape:
        raise ValueError(f"output shape {tuple(got.shape)} differs from eager's {tuple(want.shape)}")
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def isa_text(machine: dict) -> str:
    """The machine's ISA figures in words: the ones it has, else the ones it lacks."""
    isa = machine.get("isa", {})
    have = [k for k, v in isa.items() if v]
    return ", ".join(have) if have else ("no " + ", no ".join(isa) if isa else "ISA unknown")


def _isa(flags: frozenset[str]) -> dict:
    """What decides CPU kernel speed here (native bf16 above all), by the flags' own names."""
    if "asimd" in flags or "neon" in flags:  # ARM: bf16 and SVE are ARMv8.6 / v8.2 extensions
        return {"sve": "sve" in flags, "bf16": "bf16" in flags, "i8mm": "i8mm" in flags}
    if flags:
        return {"avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
                "amx_bf16": "amx_bf16" in flags}
    return {}


def machine_line(machine: dict) -> str:
    """One line for a table's header: CPU, its ISA figures, cores, versions, date."""
    return (f"Machine: {machine.get('cpu', '?')} ({isa_text(machine)}), {machine.get('cpu_count', '?')} "
            f"cores, torch {machine.get('torch', '?')}, transformers {machine.get('transformers', '?')}, "
            f"{machine.get('date', '')}")


def machine_info() -> dict:
    """CPU model and flags, cores, threads, library versions, date, load: the table's header."""
    cpu, flags = cpu_info()
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {
        "cpu": cpu,
        "isa": _isa(flags),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_at_start": load_average(),
    }


def load_average() -> float | None:
    """1-minute load average (other work on the machine shows here), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def command_line(result: dict) -> str:
    """A results file's first line: the command, the machine it ran on, torch, the date."""
    m = result["machine"]
    return (f"`{result['command']}` — {m.get('cpu', '?')} ({isa_text(m)}), {m.get('cpu_count', '?')} "
            f"cores, torch {m.get('torch', '?')}, {m.get('date', '?')}")


def write_result(out_dir: str | None, stem: str, result: dict, markdown: str) -> None:
    """``<stem>.json`` (every number) and ``<STEM>.md`` (the tables) into ``out_dir``; prints
    the tables (only that, when ``out_dir`` is None)."""
    import json
    import os
    if out_dir is None:
        print(markdown)
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{stem.upper()}.md"), "w") as f:
        f.write(markdown)
    print(markdown)


def exit_text(returncode: int) -> str:
    """How a child ended, in words: a signal by name (a crash leaves stderr empty but for what
    faulthandler, enabled in the child, writes), else its exit status."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


def error_line(error: str, width: int = 200) -> str:
    """A failed child's error in one line for a table: how it ended, and for a crash the
    faulthandler's "Fatal Python error" and the crashing thread's innermost frame, else the
    last line (an exception's message)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    if not lines:
        return "failed, nothing written to stderr"
    if not lines[0].startswith("killed by"):
        return lines[-1][:width]
    head = lines[0]
    fatal = next((x for x in lines if x.startswith("Fatal Python error")), "")
    after = [x for i, x in enumerate(lines) if i and lines[i - 1].startswith("Current thread")]
    return "; ".join(x for x in (head, fatal, after[0] if after else "") if x)[:width]


def in_fresh_process(cmd: list[str], knowledge_base: bool = False) -> subprocess.CompletedProcess:
    """``cmd`` run in a new process with an empty Inductor cache of its own (and, with
    ``knowledge_base``, an empty rewriter knowledge base): a one-time cost taken cold, nothing
    left by an earlier configuration. Output captured as text."""
    with tempfile.TemporaryDirectory(prefix="cold_") as scratch:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
               "PYTHONFAULTHANDLER": "1"}  # a crash's Python stack in its stderr
        if knowledge_base:
            env["REWRITER_KNOWLEDGE_BASE"] = os.path.join(scratch, "knowledge_base.json")
        return subprocess.run(cmd, env=env, capture_output=True, text=True)


def result_in_fresh_process(cmd: list[str], failed: dict, knowledge_base: bool = False) -> dict:
    """:func:`in_fresh_process` of a child that prints its result as JSON on its last line: that
    result, or, where the child failed, ``failed`` with the tail of its stderr as ``"error"``."""
    out = in_fresh_process(cmd, knowledge_base=knowledge_base)
    if out.returncode != 0:
        stderr = out.stderr.split("\nExtension modules:")[0]  # a crash dump's long module list
        return {**failed, "error": exit_text(out.returncode) + "\n" + stderr.strip()[-1500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])
