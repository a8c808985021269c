"""Regional rewriting against depth, whole-model capture and torch.compile's first step.

    python -m benchmarks.regional --out benchmarks            # ~10 min on 2 cores
    python -m benchmarks.regional --depths 4 --no-compile --out /tmp/r

The zoo's LLaMA config (hidden 256, 4x256 tokens, fp32 training with AdamW), afresh (no
knowledge base, Dynamo reset before each run, as a new process), at each depth:

- optimize() with ``compile=False`` (what deciding the rewrites costs; regional: each decoder
  layer class decided once) and with ``regional=False`` too (one capture of the whole model):
  seconds, of which the capture, the graphs captured, the block graphs, the kept passes; at
  the deepest depth also with the defaults (``compile="auto"``: the compiler is a candidate
  when its predicted cost can repay within the run, a one-time cost weighed apart);
- the floor of the fixed whole-model runs any measuring optimize() makes (the reference, the
  composed model's verification, the step check's fewest pairs), from one eager step;
- torch.compile's (Inductor's) first training step, with a cold Inductor cache of its own, in
  a fresh process; at the deepest depth also optimize(compile=True) (each block graph compiled
  once), likewise, and then both compiled steps timed side by side in one process.

Then activation checkpointing (``model.gradient_checkpointing_enable()``) at 4 layers: the
sites each pass finds and whether it is kept, with and without (``use_cache=False`` both ways,
as transformers sets it under checkpointing: the same model). Writes ``REGIONAL.md`` and
``regional.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from benchmarks.configs import make_step, plain_optimizer
from benchmarks.decisions import FEWEST_WHOLE_STEPS, _case, timed_optimize
from benchmarks.measure import command_line, machine_info, write_result

MODEL = "llama"


def _say(msg: str) -> None:
    print(f"[regional {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def optimize_run(layers: int, regional: Any, checkpointing: bool | None = None,
                 compile: Any = False) -> dict[str, Any]:
    """``checkpointing``: None leaves the model as built; False/True compares like with like
    (``use_cache=False`` both ways, as transformers sets it under checkpointing). ``compile``:
    False (the cost of deciding the rewrites), "auto" (optimize()'s default: also the compiler
    as a candidate, when its predicted cost can repay within the run)."""
    torch._dynamo.reset()
    case = _case(MODEL, layers)
    if checkpointing is not None:
        case.model.config.use_cache = False
    if checkpointing:
        case.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fast, _, seconds = timed_optimize(case, knowledge_base=False, regional=regional, compile=compile)
    r = fast.report
    blocks = r.blocks or []
    out = {"layers": layers, "regional": r.front_end == "regional", "seconds": round(seconds, 2),
           "capture_s": round(r.phases.get("capture", 0.0), 2), "graphs": r.graphs,
           "block_graphs": sum(len(b["graphs"]) for b in blocks),
           "kept": r.kept_passes, "phases": {k: round(v, 2) for k, v in r.phases.items()},
           "sites": {d.pass_name: len(d.sites) for d in r.decisions if d.sites},
           "statuses": {d.pass_name: d.status for d in r.decisions
                        if d.status not in ("not applicable", "no sites")},
           "final": r.final.get("reason", "")}
    fast.restore()
    return out


def eager_step_s(layers: int) -> float:
    case = _case(MODEL, layers)
    step = make_step(case.model, case.inputs, optimizer=plain_optimizer(case.model, True),
                     loss_fn=case.loss_fn)
    step()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextlib.contextmanager
def cold_inductor_cache() -> Iterator[None]:
    """An Inductor cache of its own (empty), as on a user's first compile."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def compile_first_step(layers: int) -> tuple[float, Callable[[], Any]]:
    """torch.compile (Inductor) of the whole model: its first training step with a cold cache,
    in seconds, and the compiled step."""
    torch._dynamo.reset()
    with cold_inductor_cache():
        case = _case(MODEL, layers)
        step = make_step(torch.compile(case.model), case.inputs,
                         optimizer=plain_optimizer(case.model, True), loss_fn=case.loss_fn)
        started = time.perf_counter()
        step()
        return time.perf_counter() - started, step


def optimize_compiled(layers: int) -> tuple[dict[str, Any], Callable[[], Any]]:
    """optimize(compile=True) (regional: each block graph compiled once for all its instances),
    cold Inductor cache: its seconds, the compile decision and its first compiled step, and the
    step it returns."""
    with cold_inductor_cache():
        case = _case(MODEL, layers)
        fast, opt, seconds = timed_optimize(case, compile=True, knowledge_base=False)
    d = next((d for d in fast.report.decisions if d.pass_name == "compile"), None)
    row = {"seconds": round(seconds, 2), "kept": fast.report.kept_passes,
           "compile_status": d.status if d else "not tried",
           "compile_reason": d.reason if d else "",
           "first_compiled_step_s": (d.measurement or {}).get("compile_seconds") if d else None}
    return row, make_step(fast, case.inputs, optimizer=opt, loss_fn=case.loss_fn)


def compile_first_step_s(layers: int) -> float:
    return round(compile_first_step(layers)[0], 2)


def optimize_compiled_row(layers: int) -> dict[str, Any]:
    return optimize_compiled(layers)[0]


def in_fresh_process(name: str, layers: int) -> Any:
    """``name(layers)`` of this module in a process of its own: Inductor keeps the kernels it
    built in memory, so a compile after another in one process would reuse them (not cold)."""
    code = (f"import json, benchmarks.regional as r; print('RESULT ' + json.dumps(r.{name}({layers})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    line = next(x for x in reversed(out.splitlines()) if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def side_by_side_ms(a: Callable[[], Any], b: Callable[[], Any], pairs: int = 5) -> tuple[float, float]:
    """Median step times of ``a`` and ``b``, interleaved (one process, the same load on both)."""
    times: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(pairs):
        for k, step in (("a", a), ("b", b)):
            started = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - started)
    return 1e3 * statistics.median(times["a"]), 1e3 * statistics.median(times["b"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.regional", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--depths", nargs="+", type=int, default=[4, 16])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time torch.compile's first step at the deepest depth")
    p.add_argument("--optimize-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also optimize(compile=True) at the deepest depth, beside torch.compile")
    p.add_argument("--whole", action=argparse.BooleanOptionalAction, default=True,
                   help="also run regional=False at each depth")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    machine = machine_info()
    command = "python -m benchmarks.regional " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {"machine": machine, "command": command, "depth": [], "checkpointing": {}}
    for layers in args.depths:
        row: dict[str, Any] = {"layers": layers}
        _say(f"{layers} layers: optimize() regional")
        row["regional"] = optimize_run(layers, "auto")
        if args.whole:
            _say(f"{layers} layers: optimize() whole model")
            row["whole"] = optimize_run(layers, False)
        row["eager_step_s"] = round(eager_step_s(layers), 3)
        row["floor_s"] = round(FEWEST_WHOLE_STEPS * row["eager_step_s"], 2)
        if layers == max(args.depths):
            _say(f"{layers} layers: optimize() with the defaults (compile='auto')")
            row["defaults"] = optimize_run(layers, "auto", compile="auto")
        if args.compile and layers == max(args.depths):
            _say(f"{layers} layers: torch.compile first step (a fresh process, cold caches)")
            row["compile_first_step_s"] = in_fresh_process("compile_first_step_s", layers)
            if args.optimize_compile:
                _say(f"{layers} layers: optimize(compile=True) (a fresh process, cold caches)")
                row["optimize_compile"] = in_fresh_process("optimize_compiled_row", layers)
                _say(f"{layers} layers: both compiled steps, side by side in this process")
                _, compiled_step = compile_first_step(layers)
                here, ours = optimize_compiled(layers)
                mine, theirs = side_by_side_ms(ours, compiled_step)
                row["optimize_compile"].update(step_ms=round(mine, 1), torch_compile_step_ms=round(theirs, 1),
                                               compile_status_side_by_side=here["compile_status"])
            torch._dynamo.reset()
        result["depth"].append(row)
    _say("checkpointing")
    shallow = min(args.depths)
    result["checkpointing"] = {"off": optimize_run(shallow, "auto", checkpointing=False),
                               "on": optimize_run(shallow, "auto", checkpointing=True)}
    write_result(args.out, "regional", result, to_markdown(result))
    return 0


def to_markdown(result: dict[str, Any]) -> str:
    lines = [command_line(result), "",
             f"## Cost against depth ({MODEL} config, fp32 training, afresh, compile=False)", "",
             "| layers | capture | optimize() s | of it capture s | graphs | block graphs | kept | "
             "fixed whole-model runs s (floor) | torch.compile first step s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["depth"]:
        for kind in ("regional", "whole"):
            r = row.get(kind)
            if r is None:
                continue
            lines.append(f"| {row['layers']} | {kind} | {r['seconds']} | {r['capture_s']} | {r['graphs']} | "
                         f"{r['block_graphs']} | {', '.join(r['kept']) or '-'} | {row['floor_s']} | "
                         f"{row.get('compile_first_step_s', '-') if kind == 'regional' else ''} |")
    depth = {row["layers"]: row for row in result["depth"]}
    if len(depth) >= 2:
        lo, hi = min(depth), max(depth)
        a, b = depth[lo]["regional"]["seconds"], depth[hi]["regional"]["seconds"]
        growth = depth[hi]["floor_s"] - depth[lo]["floor_s"]
        lines += ["", f"Regional, {hi} against {lo} layers: {b} s against {a} s; {lo} layers plus the "
                  f"growth of the fixed whole-model runs ({growth:.2f} s): {a + growth:.2f} s."]
        d = depth[hi].get("defaults")
        if d:
            lines.append(f"With the defaults (compile='auto') at {hi} layers: {d['seconds']} s, kept "
                         f"{', '.join(d['kept']) or '-'}; compile {d['statuses'].get('compile', 'not tried')} "
                         f"(phases: {', '.join(f'{k} {v}' for k, v in d['phases'].items())}).")
        if "compile_first_step_s" in depth[hi]:
            c = depth[hi]["compile_first_step_s"]
            lines.append(f"optimize() at {hi} layers / torch.compile's first step at {hi} layers: "
                         f"{b} / {c} = {b / c:.2f}.")
        oc = depth[hi].get("optimize_compile")
        if oc:
            first = oc.get("first_compiled_step_s")
            lines += ["", f"optimize(compile=True) at {hi} layers: {oc['seconds']} s in all; compile "
                      f"{oc['compile_status']}, its first compiled step {first} s"
                      + (f" ({first / depth[hi]['compile_first_step_s']:.2f} of torch.compile's)" if first else "")
                      + f"; both cold, each in a process of its own. Step {oc['step_ms']} ms against "
                      f"torch.compile's {oc['torch_compile_step_ms']} ms (medians of 5 interleaved pairs, one "
                      f"process; its compile {oc.get('compile_status_side_by_side', '?')} there)."]
    ck = result.get("checkpointing") or {}
    if ck:
        lines += ["", "## Activation checkpointing (transformers' switch, non-reentrant)", "",
                  "| pass | sites, off | status, off | sites, on | status, on |", "|---|---|---|---|---|"]
        names = sorted(set(ck["off"]["sites"]) | set(ck["on"]["sites"]))
        for n in names:
            lines.append(f"| {n} | {ck['off']['sites'].get(n, 0)} | {ck['off']['statuses'].get(n, '-')} | "
                         f"{ck['on']['sites'].get(n, 0)} | {ck['on']['statuses'].get(n, '-')} |")
        lines.append(f"| (kept) | | {', '.join(ck['off']['kept'])} | | {', '.join(ck['on']['kept'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
