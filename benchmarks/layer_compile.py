"""Where torch.compile's gain sits: each decoder layer compiled (PyTorch's regional recipe)
against the whole model compiled, both beside eager in this process, fused AdamW everywhere::

    python -m benchmarks.layer_compile                     # llama, training, benchmark sizes
    python -m benchmarks.layer_compile --model gpt2 --quick

Prints one JSON line per form: the first compiled step's seconds (the compile) and the speedup
over eager (the median of paired ratios, interleaved, ``benchmarks.measure.side_by_side``).
The gap between the two is the part of the gain a regional compile leaves in the graphs
around the blocks (embeddings, the LM head, the loss). Run each form in a fresh process
(``--form``) to keep Inductor's in-memory caches from one out of the other's first step.
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from typing import Sequence

import torch

FORMS = ("layers", "whole")


def run_form(model_name: str, form: str, quick: bool) -> dict:
    from benchmarks.configs import make_step
    from benchmarks.measure import BENCH_GATE, QUICK_GATE, machine_info, side_by_side
    from benchmarks.models import build_case

    case = build_case(model_name, quick=quick, training=True)
    eager = case.model
    compiled = copy.deepcopy(eager)
    if form == "layers":
        blocks = [m for m in compiled.modules() if type(m).__name__ in set(compiled._no_split_modules or ())]
        for block in blocks:
            block.compile()
    else:
        compiled = torch.compile(compiled)
    steps = [make_step(m, case.inputs, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True),
                       loss_fn=case.loss_fn) for m in (eager, compiled)]
    started = time.perf_counter()
    steps[1]()
    first = time.perf_counter() - started
    m = side_by_side(steps[0], steps[1], QUICK_GATE if quick else BENCH_GATE)
    cpu = machine_info().get("cpu")
    return {"model": model_name, "form": form, "first_compiled_step_s": round(first, 1),
            "speedup": round(m.speedup, 3), "noise": round(m.noise, 3),
            "eager_ms": round(m.baseline_ms, 1), "compiled_ms": round(m.candidate_ms, 1), "cpu": cpu}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=("llama", "gpt2", "bert"))
    p.add_argument("--quick", action="store_true", help="tiny sizes, few pairs (checks the script runs)")
    p.add_argument("--form", choices=FORMS, help="one form in this process (the parent runs each in its own)")
    args = p.parse_args(argv)
    if args.form:
        print(json.dumps(run_form(args.model, args.form, args.quick)))
        return 0
    for form in FORMS:
        cmd = [sys.executable, "-m", "benchmarks.layer_compile", "--model", args.model, "--form", form]
        out = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        print(out.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
