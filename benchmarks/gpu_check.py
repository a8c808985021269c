"""The CUDA path end to end, in one command (under 4 minutes on a recent GPU)::

    python -m benchmarks.gpu_check

On a CUDA machine it builds a small Llama (transformers, eager attention, random weights),
trains it with ``AdamW``, and runs ``optimize()`` twice: fp32 (``compile=False``), then
``dtype=torch.bfloat16, compile=True``. It checks what the CUDA path promises: the capture, the
SDPA (flash) rewrite of the written-out attention, the fused AdamW, bf16, the gate timing with
CUDA events (``rewriter.decide.gate.EventClock``), and Inductor as a gated candidate. It prints one
Markdown table, one row per check (layout: :data:`COLUMNS`, see :func:`table`)::

    | check | result | figure | detail |
    |---|---|---|---|
    | device | NVIDIA H200 | torch 2.x, triton yes | |
    | fuse_attention (fp32) | kept | 1.840x ±0.010 | region, 4 site(s): faster: ... |

Without a CUDA device it prints ``gpu_check skipped: no CUDA device`` and exits 0.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import torch

COLUMNS = ("check", "result", "figure", "detail")
# Each optimize() run is bounded so the whole check stays under 4 minutes.
TIME_BUDGET = 50.0
SIZE = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4, "vocab": 8000, "batch": 8, "seq": 512}


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The check's table in Markdown: a header of :data:`COLUMNS`, one line per row (missing
    cells empty, ``|`` escaped, newlines flattened)."""
    def cell(v: Any) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _figure(d: Any) -> str:
    if d.speedup is None or d.noise is None:
        return ""
    return f"{d.speedup:.3f}x ±{d.noise:.3f}"


def _llama(device: str = "cuda", size: dict | None = None) -> tuple[torch.nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM
    s = size or SIZE
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=4 * s["hidden"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device).train()
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    return model, {"input_ids": ids, "labels": ids}


def _optimize_rows(label: str, device: str = "cuda", size: dict | None = None,
                   **options: Any) -> list[dict]:
    import rewriter
    model, inputs = _llama(device, size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    fast, _ = rewriter.optimize(model, inputs, optimizer=opt, time_budget=TIME_BUDGET, profile=False,
                                progress=False, **options)
    seconds = time.perf_counter() - started
    r = fast.report
    rows = [{"check": f"capture ({label})", "result": r.front_end, "figure": f"{r.graphs} graph(s)",
             "detail": r.front_end_reason}]
    for d in r.decisions:
        if d.pass_name in ("fuse_attention", "fuse_optimizer", "cast_to_half", "compile") or d.kept:
            detail = d.reason
            if d.pass_name == "compile" and d.measurement and "compile_seconds" in d.measurement:
                detail = f"compile {d.measurement['compile_seconds']:.1f} s; {detail}"
            rows.append({"check": f"{d.pass_name} ({label})", "result": d.status,
                         "figure": _figure(d), "detail": detail})
    final = r.final
    speed = (f"{final['speedup']:.3f}x ±{final['noise']:.3f}"
             if final.get("speedup") is not None and final.get("noise") is not None else "")
    rows.append({"check": f"whole step ({label})", "result": "optimized" if final.get("kept") else "original",
                 "figure": speed, "detail": f"optimize() {seconds:.0f} s; phases {r.phases}; "
                 + str(final.get("reason", ""))})
    del model, fast, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_checks() -> list[dict]:
    """Every check on this CUDA device, as table rows (a check that raises is a row too)."""
    from torch.utils._triton import has_triton

    from rewriter.decide.gate import EventClock, device_clock
    from rewriter.devices.backends import get_backend
    rows: list[dict] = [{"check": "device", "result": torch.cuda.get_device_name(),
                         "figure": f"torch {torch.__version__}, triton {'yes' if has_triton() else 'no'}",
                         "detail": f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}"}]
    clock = device_clock(get_backend("cuda"))
    rows.append({"check": "gate clock", "result": type(clock).__name__,
                 "figure": "", "detail": "CUDA events" if isinstance(clock, EventClock) else "host clock"})
    for label, options in (("fp32", {"compile": False}),
                           ("bf16+compile", {"dtype": torch.bfloat16, "compile": True})):
        try:
            rows += _optimize_rows(label, **options)
        except Exception as e:  # the table still prints; the failing check says why
            rows.append({"check": f"optimize ({label})", "result": "raised",
                         "detail": f"{type(e).__name__}: {e}"})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 when every check ran (or no CUDA device: skipped), 1 when one raised."""
    if not torch.cuda.is_available():
        print("gpu_check skipped: no CUDA device")
        return 0
    started = time.perf_counter()
    rows = run_checks()
    print(table(rows))
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 1 if any(r.get("result") == "raised" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
