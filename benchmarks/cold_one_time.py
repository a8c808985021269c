"""One-time costs taken cold: each configuration alone in a fresh Python process, with an empty
Inductor cache and an empty knowledge base of its own::

    python -m benchmarks.cold_one_time --out benchmarks            # llama gpt2 bert, training
    python -m benchmarks.cold_one_time --models bert --configs compile optimize_steps20k
    python -m benchmarks.cold_one_time --models mistral phi3 --configs compile optimize_steps20k
    python -m benchmarks.cold_one_time --quick                     # tiny sizes: checks it runs
    python -m benchmarks.cold_one_time --models llama --layers 8 --configs compile_expert_autocast optimize_bf16_steps20k
    python -m benchmarks.cold_one_time --models gpt2 bert --configs compile_expert_autocast optimize_bf16_steps20k --repeat 3

In ``benchmarks.run`` every configuration shares one process and one Inductor cache: a
configuration that runs after another finds Inductor imported, its ISA checks done and, for
the same graphs, its kernels built (optimize()'s compile of the original model hits the
torch.compile row's). Here nothing is shared: the one-time cost is what a user pays in a new
process, ``optimize()``'s wall time (compile included) plus the first step (torch.compile: its
first step, the compile). Configurations run one after another, never side by side. A cold
process's seconds vary from one to the next on a shared machine (the same configuration 30.9 and
33.6 s an hour apart, 2-core Xeon): ``--repeat N`` runs each model's configurations N times,
alternating their order (A B, B A, ...), and reports the medians and, for two configurations, the
median of the per-round ratios (the second over the first) with their range.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Sequence

DEFAULT_MODELS = ("llama", "gpt2", "bert")
DEFAULT_CONFIGS = ("compile", "optimize_steps100", "optimize_steps20k")


def one_time(model: str, config: str, quick: bool, layers: int | None = None) -> dict:
    """In this process: build the case (``layers``: at the benchmark size with that many), prepare
    ``config``, run its first step; the seconds."""
    import copy

    from benchmarks.configs import CONFIGS, Setup
    from benchmarks.decisions import _case
    from benchmarks.models import build_case

    case = _case(model, layers) if layers else build_case(model, quick=quick, training=True)
    setup = Setup(case, copy.deepcopy(case.model), True, quick)
    started = time.perf_counter()
    variant = CONFIGS[config].prepare(setup)
    prepared = time.perf_counter()
    variant.step()
    first = time.perf_counter() - prepared
    return {"model": model if not layers else f"{model} ({layers} layers)", "config": config,
            "one_time_s": round(prepared - started + first, 2),
            "optimize_s": None if variant.optimize_seconds is None else round(variant.optimize_seconds, 2),
            "first_step_s": round(first, 2), "kept": [d for d in variant.notes if d.startswith("kept")]}


def cold(model: str, config: str, quick: bool, layers: int | None = None) -> dict:
    """:func:`one_time` in a fresh process with an empty Inductor cache and knowledge base."""
    from benchmarks.measure import result_in_fresh_process

    cmd = [sys.executable, "-m", "benchmarks.cold_one_time", "--one", model, config] + \
        (["--quick"] if quick else []) + (["--layers", str(layers)] if layers else [])
    return result_in_fresh_process(cmd, {"model": model, "config": config}, knowledge_base=True)


def markdown(rows: list[dict], command: str, machine: dict) -> str:
    from benchmarks.measure import error_line, machine_line

    lines = ["# One-time costs, each configuration cold in a process of its own", "",
             f"Command: `{command}`", "",
             machine_line(machine), "",
             "One-time s: optimize()'s wall time (compile included) plus the first step; for "
             "torch.compile, its first step (the compile). Each in a fresh process with an empty "
             "Inductor cache and knowledge base; one after another.", "",
             "| model | config | one-time s | optimize() s | first step s | notes |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['config']} | failed | | | {error_line(r['error'])} |")
            continue
        opt = "-" if r["optimize_s"] is None else r["optimize_s"]
        label = r["model"] + (f", round {r['round']}" if "round" in r else "")
        lines.append(f"| {label} | {r['config']} | {r['one_time_s']} | {opt} | {r['first_step_s']} | "
                     f"{'; '.join(r['kept'])} |")
    if any(r.get("round", 0) for r in rows):
        lines += [""] + summary(rows)
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> list[str]:
    """Per model and configuration, the median one-time seconds over the rounds (and their range);
    for two configurations, the second's over the first's, round by round (each round's pair ran
    back to back), as the median and range of those ratios."""
    ok = [r for r in rows if "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in ok))
    configs = list(dict.fromkeys(r["config"] for r in ok))
    lines = ["Over the rounds (alternating order):", "",
             "| model | " + " | ".join(f"{c} one-time s, median (range)" for c in configs)
             + (f" | {configs[1]} / {configs[0]}, median of the rounds' ratios (range)" if len(configs) == 2 else "")
             + " |", "|---|" + "---|" * (len(configs) + (len(configs) == 2))]
    for m in models:
        cells = []
        for c in configs:
            t = [r["one_time_s"] for r in ok if r["model"] == m and r["config"] == c]
            cells.append(f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})" if t else "-")
        if len(configs) == 2:
            by_round = {}
            for r in ok:
                if r["model"] == m:
                    by_round.setdefault(r.get("round", 0), {})[r["config"]] = r["one_time_s"]
            ratios = [d[configs[1]] / d[configs[0]] for d in by_round.values() if len(d) == 2]
            cells.append(f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.configs import CONFIG_NAMES
    from benchmarks.models import ALL_MODEL_NAMES

    p = argparse.ArgumentParser(prog="python -m benchmarks.cold_one_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=ALL_MODEL_NAMES,
                   help=f"default: {' '.join(DEFAULT_MODELS)}")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=CONFIG_NAMES)
    p.add_argument("--quick", action="store_true", help="tiny sizes (checks the script runs)")
    p.add_argument("--layers", type=int, help="the models at the benchmark size with this many layers")
    p.add_argument("--out", help="folder for COLD_ONE_TIME.md and cold_one_time.json")
    p.add_argument("--repeat", type=int, default=1, help="rounds per model, the configurations' "
                   "order alternating (default 1)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_time(*args.one, args.quick, args.layers)))
        return 0
    from benchmarks.measure import machine_info, write_result

    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    rows = []
    for model in args.models:
        for round_ in range(args.repeat):
            for config in (args.configs if round_ % 2 == 0 else args.configs[::-1]):
                rows.append(cold(model, config, args.quick, args.layers))
                if args.repeat > 1:
                    rows[-1]["round"] = round_ + 1
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    command = "python -m benchmarks.cold_one_time " + " ".join(list(sys.argv[1:] if argv is None else argv))
    machine = machine_info()
    text = markdown(rows, command.strip(), machine)
    write_result(args.out, "cold_one_time", {"command": command, "machine": machine, "rows": rows}, text)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
