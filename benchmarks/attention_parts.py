"""Written-out attention against SDPA, forward and forward + backward apart, at a model's shapes.

    python -m benchmarks.attention_parts      # LLaMA's shapes: 4 x 4 heads x 256 x 64, causal
    python -m benchmarks.attention_parts --batch 8 --seq 512 --repeat 3
    python -m benchmarks.attention_parts --dtype bf16   # both forms in bf16 (softmax in float32)

Why fuse_attention's region decision can sit on its margin on one machine and clear it on
another: the fused kernel gains far less in training than in the forward (on a 2-core AVX2
EPYC the forward halves; forward + backward gains 1.1-1.4x, depending on the allocator). Each
line is side by side in this process (``benchmarks.measure.side_by_side``: interleaved pairs,
median ratio, its noise); ``--repeat`` measures again, to see how much one region's figure
moves from one comparison to the next.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from benchmarks.measure import BENCH_GATE, QUICK_GATE, machine_info, side_by_side

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def forms(batch: int, heads: int, seq: int, dim: int,
          dtype: torch.dtype = torch.float32) -> dict[str, Callable[..., torch.Tensor]]:
    """The two forms fuse_attention chooses between, as LLaMA's eager attention writes the first:
    scores, an additive causal mask, softmax in float32 (back to q's dtype), the weighted sum.
    In bf16 the GEMMs run in bf16 and the mask stays the fp32 model's, as under autocast or
    ``cast_to_half``."""
    scale = dim ** -0.5
    mask = torch.full((seq, seq), float("-inf")).triu(1).expand(batch, 1, seq, seq).contiguous()

    def written(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        w = torch.matmul(q, k.transpose(2, 3)) * scale + mask
        return torch.matmul(F.softmax(w, -1, dtype=torch.float32).to(q.dtype), v)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return {"written": written, "sdpa": sdpa}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_parts",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--quick", action="store_true", help="few pairs: a smoke test")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    b, h, s, d, dt = args.batch, args.heads, args.seq, args.dim, DTYPES[args.dtype]
    q = torch.randn(b, s, h, d, dtype=dt).transpose(1, 2).requires_grad_()  # as a projection's view leaves it
    k, v = (torch.randn(b, h, s, d, dtype=dt, requires_grad=True) for _ in range(2))
    grad = torch.randn(b, h, s, d, dtype=dt)
    f = forms(b, h, s, d, dt)

    def forward(form: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                form(q, k, v)
        return run

    def training(form: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.grad(form(q, k, v), (q, k, v), grad)
        return run

    m = machine_info()
    print(f"{m['cpu']}, {m['torch_threads']} threads, torch {m['torch']}; "
          f"q, k, v {b} x {h} heads x {s} x {d}, {args.dtype}, causal")
    for i in range(args.repeat):
        for label, wrap in (("forward", forward), ("forward + backward", training)):
            r = side_by_side(wrap(f["written"]), wrap(f["sdpa"]), QUICK_GATE if args.quick else BENCH_GATE)
            print(f"  {i + 1}. {label}: written {r.baseline_ms:.2f} ms, SDPA {r.candidate_ms:.2f} ms: "
                  f"{r.speedup:.2f}x ±{r.noise:.2f} over {r.pairs} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
