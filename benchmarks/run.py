"""Compare optimize() with eager, torch.compile and the hand-tuned form on the model zoo.

    python -m benchmarks.run --out benchmarks                      # the default run: all models, training
    python -m benchmarks.run --models gpt2 llama --mode infer --out /tmp/bench
    python -m benchmarks.run --quick --configs eager,optimize --out /tmp/bench  # tiny sizes

Writes ``RESULTS.md``, ``results.json`` and (with matplotlib) ``results.png`` into ``--out``,
after every model, so an interrupted run keeps what it measured. Progress goes to stderr.

Per model: build it (random weights), run eager's first step as the numerics reference, then
for each configuration: its own copy of the model, setup (optimize() / compile happen here or at
the first step), the first step (timed, compared with eager's output), one profiled step (peak
memory), then eager and the configuration side by side. A configuration that fails is a row
with its error; the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable, Iterator, Sequence

import torch

import rewriter
from benchmarks.configs import (
    CONFIG_NAMES,
    CONFIGS,
    Config,
    Setup,
    make_step,
    plain_optimizer,
)
from benchmarks.measure import (
    BENCH_GATE,
    QUICK_GATE,
    load_average,
    step_faults,
    machine_info,
    output_tensor,
    peak_memory_mb,
    relative_error,
    side_by_side,
    spread_ms,
)
from benchmarks.models import ALL_MODEL_NAMES, MODEL_NAMES, build_case
from benchmarks.results import Results, Row, faults_text, write_outputs
from rewriter.decide.gate import GateSettings

MODES = {"train": ("train",), "infer": ("infer",), "both": ("train", "infer")}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODEL_NAMES),
                   help=f"models to run, space- or comma-separated (default: {', '.join(MODEL_NAMES)}; "
                        f"also: {', '.join(n for n in ALL_MODEL_NAMES if n not in MODEL_NAMES)})")
    p.add_argument("--configs", nargs="+", default=list(CONFIG_NAMES),
                   help=f"configurations (default: all: {', '.join(CONFIG_NAMES)}); eager always runs "
                        "as the baseline, its own row only when listed")
    p.add_argument("--passes", nargs="+", default=None,
                   help="passes optimize() tries, space- or comma-separated (default: all registered)")
    p.add_argument("--mode", choices=sorted(MODES), default="train",
                   help="train: forward, loss, backward, AdamW step (default); infer: forward; both")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and few pairs: checks the script runs, measures nothing useful")
    p.add_argument("--keep-host-memory", action="store_true",
                   help="rewriter.keep_freed_host_memory() first: freed host memory stays with the "
                        "process, so no configuration (eager included) maps fresh pages each step")
    p.add_argument("--out", required=True, help="directory for RESULTS.md, results.json, results.png")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="optimize()'s progress lines, and tracebacks of failing configurations")
    args = p.parse_args(argv)
    args.models = _split(args.models, ALL_MODEL_NAMES, "model", p)
    args.configs = _split(args.configs, CONFIG_NAMES, "configuration", p)
    if args.passes is not None:
        args.passes = _split(args.passes, tuple(rewriter.registered_passes()), "pass", p)
    return args


def _split(values: list[str], known: Sequence[str], what: str, p: argparse.ArgumentParser) -> list[str]:
    names = [v for value in values for v in value.split(",") if v]
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return list(dict.fromkeys(names))


def _knowledge_base_state() -> str:
    """Where optimize() keeps its decisions, and whether earlier runs left any: a row that
    replays them costs less than one that measures."""
    from rewriter.decide.knowledge import KnowledgeBase, default_path
    path = default_path()
    if path is None:
        return "off (REWRITER_KNOWLEDGE_BASE)"
    n = len(KnowledgeBase.at(path).entries)
    return f"{path}: {n} decision(s) from earlier runs at the start" if n else f"{path}: empty at the start"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    gate = QUICK_GATE if args.quick else BENCH_GATE
    host_memory = str(rewriter.keep_freed_host_memory()) if args.keep_host_memory else "the process's default"
    results = Results(command="python -m benchmarks.run " + " ".join(argv), machine=machine_info(),
                      settings={"models": args.models, "configs": args.configs, "mode": args.mode,
                                "passes": args.passes or "all registered", "quick": args.quick,
                                "gate": asdict(gate), "knowledge_base": _knowledge_base_state(),
                                "host_memory": host_memory})
    compiles = any("compile" in c for c in args.configs)
    try:
        with _fresh_inductor_cache(compiles):
            for mode in MODES[args.mode]:
                for name in args.models:
                    model_started = time.perf_counter()
                    run_model(name, mode, args, gate, results)
                    seconds = time.perf_counter() - model_started
                    results.models.setdefault(f"{mode}/{name}", {})["seconds"] = seconds
                    _progress(f"{name} ({mode}): {seconds:.0f} s")
                    _finish(results, started, args.out)  # partial results survive a crash
                    gc.collect()
    except KeyboardInterrupt:
        paths = _finish(results, started, args.out)
        _progress("interrupted; the rows measured so far are in " + ", ".join(paths.values()))
        return 130
    paths = _finish(results, started, args.out)
    _progress(f"done in {results.total_seconds / 60:.1f} min: " + ", ".join(paths.values()))
    return 1 if any(r.error for r in results.rows) else 0


def run_model(name: str, mode: str, args: argparse.Namespace, gate: GateSettings,
              results: Results) -> None:
    """Every configuration of one model, each against eager, side by side; each row goes into
    ``results`` as soon as it is measured."""
    training = mode == "train"
    try:
        case = build_case(name, quick=args.quick, training=training)
        pristine = case.model  # never stepped: every configuration copies it
        eager_model = copy.deepcopy(pristine)
        eager_step = make_step(eager_model, case.inputs, loss_fn=case.loss_fn,
                               optimizer=plain_optimizer(eager_model, training))
        reference = output_tensor(eager_step()).detach().clone()  # first step, before any update
    except Exception as e:  # no baseline: every row of this model says why
        error = f"building the model or its eager step failed: {_error_text(e)}"
        _progress(f"{name} ({mode}): FAILED: {error}")
        results.rows += [Row(name, mode, c, CONFIGS[c].label, error=error) for c in args.configs]
        return
    results.models[f"{mode}/{name}"] = {"description": case.description,
                                        "expert": case.expert_description}
    shared: dict = {}
    for config in args.configs:
        setup = Setup(case, copy.deepcopy(pristine), training, args.quick, args.verbose, shared,
                      args.passes)
        results.rows.append(run_config(CONFIGS[config], setup, mode, eager_step, reference, gate,
                                       args.verbose))
        del setup
        torch._dynamo.reset()  # the next configuration compiles afresh (Dynamo's recompile limit)
        gc.collect()


def run_config(config: Config, setup: Setup, mode: str, eager_step: Callable[[], Any],
               reference: torch.Tensor, gate: GateSettings, verbose: bool = False) -> Row:
    """One row: setup, first step (numerics), peak memory, then side-by-side timing."""
    row = Row(model=setup.case.name, mode=mode, config=config.name, label=config.label)
    where = f"{setup.case.name} ({mode}) {config.name}"
    try:
        _progress(f"{where}: preparing")
        variant = config.prepare(setup)
        row.optimize_s, row.notes, row.decisions = variant.optimize_seconds, variant.notes, variant.decisions
        row.profile_s = variant.profile_seconds
        started = time.perf_counter()
        out = variant.step()
        row.first_step_s = time.perf_counter() - started
        row.rel_error = relative_error(out, reference)
        del out
        if variant.after_first_step is not None:
            row.notes += variant.after_first_step()
        try:
            row.peak_mb = peak_memory_mb(variant.step)
        except Exception as e:  # a profiler problem costs the memory column, not the row
            row.notes.append(f"peak memory not measured: {type(e).__name__}: {e}")
        m = side_by_side(eager_step, variant.step, gate)
        row.speedup, row.noise, row.pairs = m.speedup, m.noise, m.pairs
        row.step_ms, row.eager_ms = m.candidate_ms, m.baseline_ms
        row.spread_ms = spread_ms(m.candidate_times)
        row.times_ms = {"eager": [1e3 * t for t in m.baseline_times],
                        "config": [1e3 * t for t in m.candidate_times]}
        row.faults = step_faults(m)
        faults = f"; page faults a step {faults_text(row)}" if row.faults else ""
        _progress(f"{where}: {m.speedup:.2f}x ±{m.noise:.2f} over {m.pairs} pairs "
                  f"({m.baseline_ms:.1f} -> {m.candidate_ms:.1f} ms{faults})")
    except Exception as e:
        row.error = _error_text(e)
        _progress(f"{where}: FAILED: {row.error}")
        if verbose:
            traceback.print_exc()
    return row


def _error_text(e: BaseException) -> str:
    first_line = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first_line}"


def _finish(results: Results, started: float, out_dir: str) -> dict[str, str]:
    results.total_seconds = time.perf_counter() - started
    results.load_average_at_end = load_average()
    return write_outputs(results, out_dir)


@contextlib.contextmanager
def _fresh_inductor_cache(enabled: bool) -> Iterator[None]:
    """Compile times as a first-time user sees them: Inductor's on-disk cache starts empty
    (else a second run would report the first run's cached kernels as its compile time)."""
    if not enabled:
        yield
        return
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # an older torch: its default cache, which may be warm
        yield
        return
    with fresh_cache():
        yield


def _progress(message: str) -> None:
    print(f"[benchmarks {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
