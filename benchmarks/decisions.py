"""How optimize() decides, run after run: stability, its own cost, scaling, a busy machine.

    python -m benchmarks.decisions --out benchmarks               # the default run (~20 min)
    python -m benchmarks.decisions --models gpt2 --runs 2 --out /tmp/d
    python -m benchmarks.decisions --load --out /tmp/d            # with a concurrent CPU load

For each model of the zoo (training) and each precision (fp32, ``dtype=bf16``), optimize() runs
``--runs`` times in a row with default settings and no knowledge base (each run measures
afresh); the table says whether the decisions (kept signatures per pass, the fused optimizer)
were the same every time, how long optimize() took (median), and how much of that was the
capture (Dynamo's own first trace of the model is most of it for transformers). The LLaMA
config is also optimized at 4 and 16 layers, to see how the cost grows with depth
(``--depth-runs`` times, each followed by what any measuring run pays at either depth: Dynamo's
first call and one eager step, from which the lowest 16/4 ratio a run could reach follows).

``--load`` starts a second process that keeps one core busy with matrix products in bursts
(bounded in time: it stops with the run, at the latest after ``--load-seconds``), runs the
same optimize() calls under it, and compares their decisions with the quiet ones: a rewrite
kept under load that the quiet runs rejected is a failure of the gate.
Writes ``DECISIONS.md`` and ``decisions.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any, Sequence

import torch

import rewriter
from benchmarks.configs import make_step, plain_optimizer
from benchmarks.measure import isa_text, machine_info
from benchmarks.models import MODEL_NAMES, TRANSFORMER_SIZES, build_case, call
from rewriter.decide.confirm import fewest_pairs
from rewriter.decide.gate import GateSettings
from rewriter.pipeline import DEFAULT_TIME_BUDGET

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
# runs of the whole model (forward and backward) a measuring optimize() makes besides the capture
# at the least: the reference, the composed model's verification, the step check's fewest pairs
# (two steps each). The capture check's forward is in depth_floor's trace figure.
FEWEST_WHOLE_STEPS = 2 + 2 * fewest_pairs(GateSettings())


def _say(msg: str) -> None:
    print(f"[decisions {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def decisions_of(report: rewriter.Report) -> dict[str, Any]:
    """What a run decided, comparable across runs: per pass, the kept signatures (or kept)."""
    out: dict[str, Any] = {}
    for d in report.decisions:
        if d.status in ("not applicable", "no sites"):
            continue
        if d.regions:
            out[d.pass_name] = sorted(row["signature"][:8] for row in d.regions if row.get("kept"))
        else:
            out[d.pass_name] = d.kept
    out["(step check)"] = bool(report.final.get("kept"))
    return out


def _case(name: str, layers: int | None) -> Any:
    """The zoo's training case; with ``layers``, its default size at that depth."""
    if layers is None:
        return build_case(name, quick=False, training=True)
    import benchmarks.models as models
    base = TRANSFORMER_SIZES["default"]
    models.TRANSFORMER_SIZES["scaled"] = type(base)(layers, base.hidden, base.heads, base.vocab,
                                                    base.batch, base.seq)
    return models.BUILDERS[name]("scaled", True)


def timed_optimize(case: Any, **options: Any) -> tuple[Any, Any, float]:
    """optimize() of a training case as a user calls it (a plain AdamW, ``profile=False``,
    ``progress=False``, plus ``options``): the optimized model, its optimizer, the seconds."""
    opt = plain_optimizer(case.model, True)
    started = time.perf_counter()
    fast, opt = rewriter.optimize(case.model, case.inputs, optimizer=opt, loss_fn=case.loss_fn,
                                  profile=False, progress=False, **options)
    return fast, opt, time.perf_counter() - started


def one_run(name: str, dtype: torch.dtype | None, *, layers: int | None = None,
            knowledge_base: Any = False) -> dict[str, Any]:
    torch._dynamo.reset()  # each run captures afresh, as a new process would
    case = _case(name, layers)
    fast, _, seconds = timed_optimize(case, dtype=dtype, knowledge_base=knowledge_base)
    r = fast.report
    return {"seconds": round(seconds, 2), "phases": r.phases, "decisions": decisions_of(r),
            "reasons": {d.pass_name: d.reason for d in r.decisions
                        if d.status not in ("not applicable", "no sites")},
            "final": r.final.get("reason", "")}


def depth_floor(name: str, layers: int) -> dict[str, float]:
    """What any Dynamo-captured optimize() of this model pays whatever it decides: Dynamo's own
    first call of the model (its trace, with a backend that returns the graph as it is, and that
    graph's forward) and one eager training step (optimize() runs the whole model several times:
    the reference, the capture check, the composed model's verification, the step check's
    pairs)."""
    torch._dynamo.reset()
    case = _case(name, layers)
    compiled = torch.compile(case.model, backend=lambda gm, example_inputs: gm)
    started = time.perf_counter()
    call(compiled, case.inputs)
    trace = time.perf_counter() - started
    step = make_step(case.model, case.inputs, optimizer=plain_optimizer(case.model, True),
                     loss_fn=case.loss_fn)
    step()  # a first step allocates the optimizer's state
    times = []
    for _ in range(3):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    torch._dynamo.reset()
    return {"trace": round(trace, 2), "step": round(statistics.median(times), 3)}


def _burn(seconds: float) -> None:
    """The concurrent load: one core of matrix products in bursts of 0.2-1 s."""
    import random
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    end = time.monotonic() + seconds
    rng = random.Random(0)
    while time.monotonic() < end:
        burst = time.monotonic() + rng.uniform(0.2, 1.0)
        while time.monotonic() < burst:
            a = (a @ a).clamp_(-1, 1)
        time.sleep(rng.uniform(0.0, 0.3))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decisions", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODEL_NAMES))
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scaling", action=argparse.BooleanOptionalAction, default=True,
                   help="also LLaMA at 4 and 16 layers (default: on)")
    p.add_argument("--depth-runs", type=int, default=1,
                   help="times the 4- and 16-layer rows are run, one after another (default: 1)")
    p.add_argument("--load", action="store_true", help="also run under a concurrent CPU load")
    p.add_argument("--load-seconds", type=float, default=900.0)
    p.add_argument("--load-runs", type=int, default=2, help="optimize() runs per model under load")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    models = [m for v in args.models for m in v.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {"command": "python -m benchmarks.decisions " + " ".join(argv or sys.argv[1:]),
                              "machine": machine_info(), "rows": [], "scaling": [], "load": []}
    for name in models:
        for prec in args.precisions:
            kb = os.path.join(args.out, f".kb-{name}-{prec}.json")  # a fresh one per row
            if os.path.exists(kb):
                os.remove(kb)
            for label, where in (("afresh", False), ("knowledge base", kb)):
                runs = []
                for i in range(args.runs):
                    runs.append(one_run(name, PRECISIONS[prec], knowledge_base=where))
                    _say(f"{name} {prec} {label} run {i + 1}: {runs[-1]['seconds']} s {runs[-1]['decisions']}")
                same = all(r["decisions"] == runs[0]["decisions"] for r in runs)
                result["rows"].append({"model": name, "precision": prec, "kb": label, "runs": runs,
                                       "same": same})
                _write(args.out, result)
            os.remove(kb) if os.path.exists(kb) else None
    if args.scaling:
        result["floors"] = []
        for rep in range(1, args.depth_runs + 1):
            kb = os.path.join(args.out, ".kb-depth.json")
            if os.path.exists(kb):
                os.remove(kb)
            # afresh at 4 and 16 layers; then 4 and 16 layers sharing a knowledge base (the
            # layers' regions have the same signatures: the deeper model replays what the
            # shallower measured)
            for layers, where, label in ((4, False, "afresh"), (16, False, "afresh"), (4, kb, "knowledge base"),
                                         (16, kb, "knowledge base, after 4 layers")):
                r = one_run("llama", None, layers=layers, knowledge_base=where)
                r["layers"], r["kb"], r["rep"] = layers, label, rep
                result["scaling"].append(r)
                _say(f"llama {layers} layers ({label}, depth run {rep}): {r['seconds']} s {r['phases']}")
            os.remove(kb) if os.path.exists(kb) else None
            result["floors"].append({str(layers): depth_floor("llama", layers) for layers in (4, 16)})
            _say(f"llama floor (depth run {rep}): {result['floors'][-1]}")
            _write(args.out, result)
    if args.load:
        burner = mp.get_context("spawn").Process(target=_burn, args=(args.load_seconds,), daemon=True)
        burner.start()
        try:
            for name in models:
                for _ in range(args.load_runs):
                    r = one_run(name, None)
                    quiet = next((row for row in result["rows"] if row["model"] == name
                                  and row["precision"] == "fp32" and row.get("kb") == "afresh"), None)
                    r["model"] = name
                    r["kept_only_under_load"] = _kept_only_under_load(r, quiet)
                    result["load"].append(r)
                    _say(f"{name} under load: {r['seconds']} s {r['decisions']} "
                         f"kept only under load: {r['kept_only_under_load']}")
                    _write(args.out, result)
        finally:
            burner.terminate()
            burner.join(5)
    _write(args.out, result)
    return 0


def _kept_only_under_load(loaded: dict, quiet_row: dict | None) -> list[str]:
    """Decisions kept under load that no quiet run kept."""
    if quiet_row is None:
        return []
    found = []
    for pass_name, kept in loaded["decisions"].items():
        if pass_name == "(step check)":
            continue
        quiet = [r["decisions"].get(pass_name) for r in quiet_row["runs"]]
        if isinstance(kept, list):
            ever = {s for q in quiet if isinstance(q, list) for s in q}
            found += [f"{pass_name}[{s}]" for s in kept if s not in ever]
        elif kept and not any(q is True for q in quiet):
            found.append(pass_name)
    return found


def _write(out: str, result: dict) -> None:
    with open(os.path.join(out, "decisions.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "DECISIONS.md"), "w") as f:
        f.write(to_markdown(result))


def to_markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# optimize(): decisions run after run", "",
             f"`{result['command']}` — {m.get('cpu')} ({isa_text(m)}), {m.get('cpu_count')} cores, torch {m.get('torch')}, "
             f"{m.get('date')}, load average at start {m.get('load_average_at_start')}", "",
             "Each row: optimize() with default settings, training, run after run in one process "
             "(Dynamo reset between runs). *afresh*: no knowledge base, every run measures every "
             "region; *knowledge base*: the default, a knowledge base that starts empty, so run 1 "
             "measures and runs 2-5 replay the region decisions, the whole-step passes, the "
             "optimizer's own-step timing and the step check of the same composed step (capture, "
             "recording and verification run every time).", "",
             "| model | precision | regions | runs | same decisions | optimize() s (median, min-max) | capture s (median) | kept (first run) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        secs = [r["seconds"] for r in row["runs"]]
        cap = [r["phases"].get("capture", 0.0) for r in row["runs"]]
        kept = {k: v for k, v in row["runs"][0]["decisions"].items() if v}
        lines.append(f"| {row['model']} | {row['precision']} | {row.get('kb', 'afresh')} | {len(secs)} | {'yes' if row['same'] else '**no**'} "
                     f"| {statistics.median(secs):.1f} ({min(secs):.1f}-{max(secs):.1f}) "
                     f"| {statistics.median(cap):.1f} | {_fmt(kept)} |")
    differing = [row for row in result["rows"] if not row["same"]]
    for row in differing:
        lines += ["", f"### {row['model']} {row['precision']} ({row.get('kb', 'afresh')}): decisions per run", ""]
        for i, r in enumerate(row["runs"], 1):
            lines.append(f"- run {i}: {_fmt(r['decisions'])}")
            for pass_name, reason in r["reasons"].items():
                lines.append(f"  - {pass_name}: {reason[:220]}")
    if result["scaling"]:
        lines += ["", "## Cost against depth (LLaMA config, fp32 training)", "",
                  "| depth run | layers | regions | optimize() s | " + " | ".join(_PHASES) + " |",
                  "|---|---|---|---|" + "---|" * len(_PHASES)]
        for r in result["scaling"]:
            lines.append(f"| {r.get('rep', 1)} | {r['layers']} | {r.get('kb', 'afresh')} | {r['seconds']:.1f} | "
                         + " | ".join(f"{r['phases'].get(k, 0.0):.1f}" for k in _PHASES) + " |")
        floors = result.get("floors", [])
        ratios = {rep: _depth_ratios([r for r in result["scaling"] if r.get("rep", 1) == rep],
                                     floors[rep - 1] if rep <= len(floors) else {})
                  for rep in sorted({r.get("rep", 1) for r in result["scaling"]})}
        lines += ["", "| depth run | 16 / 4 layers, afresh | its floor | 16 after 4 (knowledge base) / 4 afresh "
                  "| its floor | Dynamo first call 4 / 16 s | eager step 4 / 16 ms |",
                  "|---|---|---|---|---|---|---|"]
        for rep, d in ratios.items():
            lines.append(f"| {rep} | {_x(d.get('afresh'))} | {_x(d.get('floor'))} | {_x(d.get('after'))} | "
                         f"{_x(d.get('floor_after'))} | "
                         + (f"{d['trace4']:.1f} / {d['trace16']:.1f} | {1000 * d['step4']:.0f} / "
                            f"{1000 * d['step16']:.0f} |" if 'floor' in d else "- | - |"))
        for what, label in (("afresh", "16 / 4 layers, afresh"), ("floor", "its floor"),
                            ("after", "16 after 4 (knowledge base) / 4 afresh"),
                            ("floor_after", "its floor")):
            got = [d[what] for d in ratios.values() if d.get(what) is not None]
            if len(got) > 1:
                lines.append(f"\nMedian of {len(got)} depth runs, {label}: {statistics.median(got):.2f}x")
        lines.append(
            f"\n*Floors*, from Dynamo's first call of the model (its trace, with a backend that "
            f"keeps the graph as it is, and one forward) and one eager training step at 4 and at "
            f"16 layers, measured after each depth run; a measuring optimize() runs the whole model "
            f"at least {FEWEST_WHOLE_STEPS} times besides that first call (the reference, the "
            f"composed model's verification, the step check's fewest pairs; the capture check's "
            f"backward and the gate's warm-up come on top). *Afresh*: the 16-layer run decides what "
            f"the 4-layer run decides (the same signatures, measured again), so, deciding as fast, "
            f"it costs the 4-layer run plus the growth of the first call and of those "
            f"{FEWEST_WHOLE_STEPS} runs. *After 4*: replaying the knowledge base, it costs at least "
            f"the 16-layer first call and those {FEWEST_WHOLE_STEPS} runs. Above 1.5x, a 16-layer "
            f"run comes within 1.5x of that 4-layer run only by deciding faster than the 4-layer run "
            f"did (afresh) or by leaving out one of those whole-model runs.")
    if result["load"]:
        lines += ["", "## Under a concurrent CPU load (one core busy in bursts)", "",
                  "*kept under load only*: kept under load, never kept in the quiet afresh runs "
                  "(a failure of the gate). *busy*: comparisons reported inconclusive because the "
                  f"machine was busy. The time budget is optimize()'s default, {DEFAULT_TIME_BUDGET:g} s.", "",
                  "| model | optimize() s | within budget | busy | kept | kept under load only |",
                  "|---|---|---|---|---|---|"]
        for r in result["load"]:
            kept = {k: v for k, v in r["decisions"].items() if v}
            busy = sum("busy" in why for why in r["reasons"].values())
            lines.append(f"| {r['model']} | {r['seconds']:.1f} | "
                         f"{'yes' if r['seconds'] <= DEFAULT_TIME_BUDGET else '**no**'} | {busy} | "
                         f"{_fmt(kept)} | {', '.join(r['kept_only_under_load']) or 'none'} |")
    return "\n".join(lines) + "\n"


def _depth_ratios(runs: list[dict], floor: dict) -> dict:
    """One depth run's ratios against its 4-layer afresh run, and the floor under each."""
    rows = {(r["layers"], r.get("kb", "afresh")): r["seconds"] for r in runs}
    a, b, c = rows.get((4, "afresh")), rows.get((16, "afresh")), rows.get((16, "knowledge base, after 4 layers"))
    out: dict = {"afresh": b / a if a and b else None, "after": c / a if a and c else None}
    f4, f16 = floor.get("4"), floor.get("16")
    if a and f4 and f16:
        grows = (f16["trace"] - f4["trace"]) + FEWEST_WHOLE_STEPS * (f16["step"] - f4["step"])
        out.update(floor=(a + grows) / a,
                   floor_after=(f16["trace"] + FEWEST_WHOLE_STEPS * f16["step"]) / a,
                   trace4=f4["trace"], trace16=f16["trace"], step4=f4["step"], step16=f16["step"])
    return out


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


_PHASES = ("reference", "capture", "rewrite", "record", "verify", "measure", "confirm")


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}" + (f" {v}" if isinstance(v, list) else "") for k, v in d.items()) or "-"


if __name__ == "__main__":
    sys.exit(main())
