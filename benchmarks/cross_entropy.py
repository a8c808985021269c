"""The cross-entropy alone, forward + backward: ``F.cross_entropy`` against
``passes.fuse_cross_entropy.fused_cross_entropy``, side by side in one process (interleaved
pairs, the gate's own measurement), at the benchmark transformers' size::

    python -m benchmarks.cross_entropy                   # 1024 x 8000 fp32 logits, 3 rounds
    python -m benchmarks.cross_entropy --rows 4096 --classes 32000
    python -m benchmarks.cross_entropy --dtype bf16      # F.cross_entropy(x.float()) against
                                                         # the fused loss on the bf16 logits

Prints the machine line and, per round, the speedup with its noise and both medians. The
backward's incoming gradient is 1 (``loss.backward()``), as in training, and the logits'
gradient is handed on (``torch.autograd.grad``), as to the layer below them, not accumulated
into a leaf's ``.grad`` (which would copy the fused form's gradient once more).
"""
from __future__ import annotations

import argparse
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F

    from benchmarks.measure import machine_info, machine_line
    from passes.fuse_cross_entropy import fused_cross_entropy
    from rewriter.decide.gate import GateSettings, Step, WallClock, measure

    p = argparse.ArgumentParser(prog="python -m benchmarks.cross_entropy",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--classes", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the logits' dtype; bf16: what optimize(dtype=bf16) hands the loss, against "
                        "transformers' upcast F.cross_entropy(logits.float())")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.classes, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, args.classes, (args.rows,), generator=g)

    def step(loss_fn):
        def run() -> None:  # the logits' gradient, as the layer below them takes it
            torch.autograd.grad(loss_fn(x, t), x)
        return run

    def upcast_cross_entropy(logits, target):
        return F.cross_entropy(logits.float(), target)

    print(machine_line(machine_info()))
    baseline = F.cross_entropy if dtype == torch.float32 else upcast_cross_entropy
    print(f"cross-entropy of [{args.rows}, {args.classes}] {args.dtype} logits, forward + backward"
          + ("" if dtype == torch.float32 else ": F.cross_entropy(logits.float()) against the fused loss"))
    settings = GateSettings(min_pairs=args.pairs, max_pairs=args.pairs, budget_seconds=60.0)
    for i in range(args.rounds):
        m = measure(Step(step(baseline), (), "F.cross_entropy"),
                    Step(step(fused_cross_entropy), ("fuse_cross_entropy",), "fused"),
                    clock=WallClock(), settings=settings)
        print(f"round {i + 1}: {m.speedup:.3f}x ±{m.noise:.3f} over {m.pairs} pairs "
              f"({m.baseline_ms:.2f} ms -> {m.candidate_ms:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
