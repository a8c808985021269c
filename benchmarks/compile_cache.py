"""How much a second compile costs with Inductor's caches warm: ``optimize(compile=True)`` on
the same model in two fresh processes sharing one knowledge base folder (a new, empty one), and
so the Inductor cache optimize() keeps beside it (rewriter.devices.compile_cache)::

    python -m benchmarks.compile_cache                 # llama, training, the benchmark sizes
    python -m benchmarks.compile_cache --quick         # tiny sizes

Prints the first compiled step's seconds (the compile the user pays) of each process and the
decision. The second process's Dynamo starts empty, so what it saves is Inductor's FX-graph and
kernel caches (and AOTAutograd's), the case of a replay or a restarted training job.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence


def child(model: str, quick: bool, training: bool) -> dict:
    import rewriter
    from benchmarks.configs import plain_optimizer
    from benchmarks.models import build_case
    case = build_case(model, quick=quick, training=training)
    opt = plain_optimizer(case.model, training)
    options = {"optimizer": opt, "loss_fn": case.loss_fn} if training else {}
    result = rewriter.optimize(case.model, case.inputs, compile=True, passes=[], profile=False,
                               progress=False, time_budget=None, **options)  # knowledge base: $REWRITER_KNOWLEDGE_BASE
    fast = result[0] if training else result
    d = next(d for d in fast.report.decisions if d.pass_name == "compile")
    return {"compile_seconds": (d.measurement or {}).get("compile_seconds"), "status": d.status,
            "speedup": d.speedup, "reason": d.reason}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_cache", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--mode", choices=("train", "infer"), default="train")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.quick, args.mode == "train")))
        return 0
    cmd = [sys.executable, "-m", "benchmarks.compile_cache", "--child", "--model", args.model,
           "--mode", args.mode] + (["--quick"] if args.quick else [])
    with tempfile.TemporaryDirectory(prefix="rewriter-kb-") as folder:
        env = dict(os.environ, REWRITER_KNOWLEDGE_BASE=os.path.join(folder, "knowledge_base.json"))
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # optimize() puts Inductor's caches beside the base
        for run in ("first (cold cache)", "second (warm cache)"):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{run}: first compiled step {r['compile_seconds']:.1f} s (compile {r['status']})")
        print(f"Inductor's cache: {os.path.join(folder, 'inductor')} "
              f"({'present' if os.path.isdir(os.path.join(folder, 'inductor')) else 'absent'})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
