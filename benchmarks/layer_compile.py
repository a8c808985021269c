"""Where torch.compile's gain sits: each decoder layer compiled (PyTorch's regional recipe)
against the whole model compiled, and the whole model compiled with each repeated block a
nested compile region (optimize()'s bf16 candidate: Inductor's buffer reuse off,
rewriter.devices.executors.without_buffer_reuse), each beside eager, fused AdamW everywhere::

    python -m benchmarks.layer_compile                     # llama, training, benchmark sizes
    python -m benchmarks.layer_compile --model gpt2 --quick
    python -m benchmarks.layer_compile --bf16 --forms whole nested   # under autocast(bf16)
    python -m benchmarks.layer_compile --bf16 --forms whole nested --layers 8

Prints one JSON line per form: the first compiled step's seconds (the compile) and the speedup
over eager (the median of paired ratios, interleaved, ``benchmarks.measure.side_by_side``).
The gap between the two is the part of the gain a regional compile leaves in the graphs
around the blocks (embeddings, the LM head, the loss). Each form runs in a fresh process
with an empty Inductor cache of its own (``--form``): its first step is a cold compile.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Sequence

import torch

FORMS = ("layers", "whole", "nested")


def run_form(model_name: str, form: str, quick: bool, bf16: bool = False, layers: int | None = None) -> dict:
    from benchmarks.configs import make_step
    from benchmarks.decisions import _case
    from benchmarks.measure import BENCH_GATE, QUICK_GATE, machine_info, side_by_side
    from benchmarks.models import build_case

    case = _case(model_name, layers) if layers else build_case(model_name, quick=quick, training=True)
    eager = case.model
    compiled = copy.deepcopy(eager)
    if form == "layers":
        blocks = [m for m in compiled.modules() if type(m).__name__ in set(compiled._no_split_modules or ())]
        for block in blocks:
            block.compile()
    elif form == "nested":
        from rewriter.capture.blocks import find_blocks
        from rewriter.devices.executors import without_buffer_reuse
        for cls in {b.cls for b in find_blocks(compiled) if len(b.instances) > 1}:
            cls.forward = torch.compiler.nested_compile_region(cls.forward)  # this process only
        compiled = torch.compile(compiled, backend=without_buffer_reuse(torch._dynamo.lookup_backend("inductor")))
    else:
        compiled = torch.compile(compiled)
    # eager in fp32 (the speedup is over the user's step); the compiled form under autocast
    steps = [make_step(m, case.inputs, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True),
                       loss_fn=case.loss_fn, autocast=bf16 and m is compiled) for m in (eager, compiled)]
    started = time.perf_counter()
    steps[1]()
    first = time.perf_counter() - started
    m = side_by_side(steps[0], steps[1], QUICK_GATE if quick else BENCH_GATE)
    cpu = machine_info().get("cpu")
    return {"model": model_name, "layers": layers, "form": form, "bf16": bf16, "first_compiled_step_s": round(first, 1),
            "speedup": round(m.speedup, 3), "noise": round(m.noise, 3),
            "eager_ms": round(m.baseline_ms, 1), "compiled_ms": round(m.candidate_ms, 1), "cpu": cpu}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=("llama", "gpt2", "bert", "qwen2", "distilbert"))
    p.add_argument("--quick", action="store_true", help="tiny sizes, few pairs (checks the script runs)")
    p.add_argument("--bf16", action="store_true", help="the compiled forms under autocast(bf16)")
    p.add_argument("--layers", type=int, help="the model at the benchmark size with this many layers")
    p.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS), help="the forms to run, in order")
    p.add_argument("--form", choices=FORMS, help="one form in this process (the parent runs each in its own)")
    args = p.parse_args(argv)
    if args.form:
        print(json.dumps(run_form(args.model, args.form, args.quick, args.bf16, args.layers)))
        return 0
    from benchmarks.measure import in_fresh_process
    for form in args.forms:
        cmd = [sys.executable, "-m", "benchmarks.layer_compile", "--model", args.model, "--form", form]
        out = in_fresh_process(cmd + (["--quick"] if args.quick else []) + (["--bf16"] if args.bf16 else [])
                               + (["--layers", str(args.layers)] if args.layers else []))
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        print(out.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
