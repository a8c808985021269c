"""optimize() against each peer directly, side by side: the two steps interleaved in one process.

``benchmarks.run`` times every configuration against eager, and reads "ahead of the peer" from
two speedups over two eager baselines. On a CPU whose allocator hands large freed tensors back,
eager's own step moves with what it is interleaved with (2-core AMD EPYC, LLaMA fp32: eager 310
ms a step mapping 11 920 fresh pages beside the compiled peer, 258 ms mapping none beside
optimize(), in one process): the two speedups then differ by the baselines as much as by the
configurations. Here the configuration and the peer are timed against each other::

    python -m benchmarks.head_to_head --out <dir>                          # the five, fp32
    python -m benchmarks.head_to_head --models llama --ours optimize_bf16_steps20k \\
        --peers compile_expert_autocast expert_autocast                      # bf16
    python -m benchmarks.head_to_head --seconds 15 --models llama            # more pairs (30 at most)
    python -m benchmarks.head_to_head --repeat 3 --out <dir>                # three fresh processes a model
    python -m benchmarks.head_to_head --quick                               # tiny sizes: it runs

Each model in a fresh process of its own (an empty Inductor cache and knowledge base): ours is
prepared first (optimize(), its decisions timed alone), then each peer, each run once; then ours
against each peer, interleaved (``benchmarks.measure.side_by_side``: the median of paired
ratios, its noise). Above 1: ours is faster. Each row also gives the fresh host pages each
step mapped (the median; glibc's heap state in that process, which moves a step by tens of ms
on a machine where a page costs microseconds: rewriter.decide.fresh_heap).

One process's figure is not the model's: the same pairing moved by more than its in-process
noise from one fresh process to the next (LLaMA fp32 against torch.compile, 2-core EPYC: 0.95x
±0.02 in one, 1.06x ±0.03 in another). ``--repeat N`` runs each model in N fresh processes and
adds, per peer, the median of the processes' figures and their range.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Sequence

DEFAULT_MODELS = ("llama", "gpt2", "bert", "qwen2", "distilbert")


def versus(model: str, ours: str, peers: Sequence[str], quick: bool, seconds: float | None = None) -> dict:
    """In this process: ``ours`` and each of ``peers`` prepared on copies of one model, then
    ours against each peer, side by side (``seconds``: each comparison's budget, BENCH_GATE's
    otherwise)."""
    import dataclasses

    from benchmarks.configs import CONFIGS, Setup
    from benchmarks.measure import BENCH_GATE, QUICK_GATE, side_by_side, step_faults
    from benchmarks.models import build_case

    case = build_case(model, quick=quick, training=True)
    gate = QUICK_GATE if quick else BENCH_GATE
    if seconds is not None and not quick:
        gate = dataclasses.replace(gate, budget_seconds=seconds)
    variants = {}
    for name in (ours, *peers):
        variants[name] = CONFIGS[name].prepare(Setup(case, copy.deepcopy(case.model), True, quick))
        variants[name].step()  # the first step (a compile) is not timed
    mine = variants[ours]
    rows = []
    for peer in peers:
        m = side_by_side(variants[peer].step, mine.step, gate)
        faults = step_faults(m) or {}
        rows.append({"peer": peer, "speedup": round(m.speedup, 4), "noise": round(m.noise, 4),
                     "pairs": m.pairs, "peer_ms": round(m.baseline_ms, 2), "ours_ms": round(m.candidate_ms, 2),
                     "peer_fresh_pages": faults.get("eager"), "ours_fresh_pages": faults.get("config")})
    kept = [n for n in mine.notes if n.startswith("kept")]
    return {"model": model, "ours": ours, "rows": rows, "kept": kept}


def in_its_own_process(model: str, ours: str, peers: Sequence[str], quick: bool,
                       seconds: float | None = None) -> dict:
    from benchmarks.measure import result_in_fresh_process
    cmd = [sys.executable, "-m", "benchmarks.head_to_head", "--one", model, "--ours", ours,
           "--peers", *peers] + (["--quick"] if quick else []) + \
        ([] if seconds is None else ["--seconds", str(seconds)])
    return result_in_fresh_process(cmd, {"model": model, "ours": ours}, knowledge_base=True)


def over_processes(rounds: list[dict]) -> list[dict]:
    """Per peer, over one model's processes (a failed one left out): the median of their
    figures (ours / peer), the lowest and the highest, and how many."""
    by_peer: dict[str, list[float]] = {}
    for r in rounds:
        for row in r.get("rows", []):
            by_peer.setdefault(row["peer"], []).append(row["speedup"])
    return [{"peer": peer, "median": round(statistics.median(v), 4), "low": min(v), "high": max(v),
             "processes": len(v)} for peer, v in by_peer.items()]


def markdown(results: list[dict], command: str, machine: dict, summary: list[dict] | None = None) -> str:
    from benchmarks.configs import CONFIGS
    from benchmarks.measure import error_line, machine_line
    lines = ["# optimize() against each peer, side by side", "", f"Command: `{command}`", "",
             machine_line(machine), "",
             "Each model in a fresh process (empty Inductor cache and knowledge base); ours and the "
             "peer interleaved in that process, after their first steps. **ours / peer**: the median "
             "of the paired ratios of the peer's step time over ours (above 1: ours is faster), "
             "± its noise. **fresh pages**: the median host pages a step mapped afresh, the peer's / ours.", "",
             "| model | ours | peer | ours / peer | pairs | peer ms | ours ms | fresh pages | kept |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        model = r["model"] + (f", process {r['process']}" if "process" in r else "")
        if "error" in r:
            lines.append(f"| {model} | {CONFIGS[r['ours']].label} | - | failed: {error_line(r['error'])} | | | | | |")
            continue
        for row in r["rows"]:
            lines.append(f"| {model} | {CONFIGS[r['ours']].label} | {CONFIGS[row['peer']].label} | "
                         f"**{row['speedup']:.2f}x** ±{row['noise']:.2f} | {row['pairs']} | "
                         f"{row['peer_ms']:.1f} | {row['ours_ms']:.1f} | {_pages(row)} | {'; '.join(r['kept'])} |")
    if summary:
        lines += ["", "Over the processes: the median of their figures (ours / peer) and the range.", "",
                  "| model | ours | peer | ours / peer, median (range) | processes |", "|---|---|---|---|---|"]
        for m in summary:
            for row in m["peers"]:
                lines.append(f"| {m['model']} | {CONFIGS[m['ours']].label} | {CONFIGS[row['peer']].label} | "
                             f"**{row['median']:.2f}x** ({row['low']:.2f}-{row['high']:.2f}) | {row['processes']} |")
    return "\n".join(lines) + "\n"


def _pages(row: dict) -> str:
    """The fresh pages a step mapped, the peer's / ours ("-" where not counted)."""
    def one(n: float | None) -> str:
        return "-" if n is None else f"{n:.0f}"
    return f"{one(row.get('peer_fresh_pages'))} / {one(row.get('ours_fresh_pages'))}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from benchmarks.configs import CONFIG_NAMES
    p = argparse.ArgumentParser(prog="python -m benchmarks.head_to_head", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--ours", default="optimize_steps20k", choices=CONFIG_NAMES)
    p.add_argument("--peers", nargs="+", default=["compile", "expert"], choices=CONFIG_NAMES)
    p.add_argument("--quick", action="store_true", help="tiny sizes and few pairs: checks it runs")
    p.add_argument("--seconds", type=float, help="each comparison's time budget (default: BENCH_GATE's "
                   "5 s, ~10 pairs of 250 ms steps; 30 pairs at most)")
    p.add_argument("--repeat", type=int, default=1, help="fresh processes per model (default 1); "
                   "above 1, each peer's median over them and their range are added")
    p.add_argument("--out", help="folder for HEAD_TO_HEAD.md and head_to_head.json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child: one model, its result as JSON
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(versus(args.one, args.ours, args.peers, args.quick, args.seconds)))
        return 0
    from benchmarks.measure import machine_info, write_result
    command = "python -m benchmarks.head_to_head " + " ".join(sys.argv[1:] if argv is None else argv)
    results, summary = [], []
    for model in args.models:
        rounds = []
        for k in range(args.repeat):
            started = time.perf_counter()
            rounds.append(in_its_own_process(model, args.ours, args.peers, args.quick, args.seconds))
            if args.repeat > 1:
                rounds[-1]["process"] = k + 1
            print(f"[head_to_head] {model}: {time.perf_counter() - started:.0f} s "
                  f"{json.dumps(rounds[-1].get('rows', rounds[-1].get('error', ''))[:3])[:400]}", flush=True)
        results += rounds
        if args.repeat > 1:
            summary.append({"model": model, "ours": args.ours, "peers": over_processes(rounds)})
    machine = machine_info()
    write_result(args.out, "head_to_head",
                 {"command": command, "machine": machine, "results": results, "over_processes": summary},
                 markdown(results, command, machine, summary))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
