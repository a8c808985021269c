"""The CUDA path end to end, in one command (under 4 minutes on a recent GPU)::

    python -m benchmarks.gpu_check

On a CUDA machine it builds a small Llama (transformers, eager attention, random weights),
trains it with ``AdamW``, and runs ``optimize()`` on it twice: fp32 (``compile=False``), then
``dtype=torch.bfloat16, compile=True``; between the two, greedy ``generate()`` of a small Qwen2
(eval, dynamic KV cache) through optimize()'s model, its tokens against the original's and its
speed against eager. It checks what the CUDA path promises: the regional capture (one graph per
block class), the SDPA (flash) rewrite of the written-out attention, the fused AdamW, bf16, the
gate timing with CUDA events (``rewriter.decide.gate.EventClock``), generation through the
installed blocks, and Inductor as a gated candidate. Each section prints its rows as it ends, then
the whole Markdown table, one row per check (layout: :data:`COLUMNS`, see :func:`table`)::

    | check | result | figure | detail |
    |---|---|---|---|
    | device | NVIDIA H200 | torch 2.x, triton yes | |
    | fuse_attention (fp32) | kept | 1.840x ±0.010 | region, 4 site(s): faster: ... |

Without a CUDA device it prints ``gpu_check skipped: no CUDA device`` and exits 0.
"""
from __future__ import annotations

import sys
import time
import traceback
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
    rows += _block_rows(r, f"block {{}} ({label})")
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


def _block_rows(report: Any, check: str) -> list[dict]:
    """A row per block class of the report: ``check`` with the class name in its ``{}``."""
    return [{"check": check.format(b["class"]), "result": f"x{b['instances']}",
             "figure": ", ".join(f"{g} ({n} nodes)" for g, n in zip(b["graphs"], b["nodes"])),
             "detail": "kept: " + (", ".join(b.get("passes", [])) or "none")} for b in report.blocks]


GENERATE = {"layers": 4, "hidden": 512, "inter": 1408, "heads": 8, "kv": 2, "vocab": 8000, "prompt": 64,
            "new": 32}


def _generate_rows(device: str = "cuda", size: dict | None = None) -> list[dict]:
    """Greedy generate() through optimize()'s model (eval, dynamic KV cache): the tokens against the
    original's, and the speed against eager generate(), interleaved in this process."""
    import copy

    import rewriter
    from benchmarks.generate import build_model, generator
    from benchmarks.measure import BENCH_GATE, QUICK_GATE, side_by_side
    s = size or GENERATE
    model = build_model(s, torch.float32).to(device)
    prompt = torch.randint(0, s["vocab"], (1, s["prompt"]), device=device)
    want = generator(model, prompt, s["new"])()
    started = time.perf_counter()
    fast = rewriter.optimize(copy.deepcopy(model), example_inputs=(prompt,), knowledge_base=False,
                             progress=False, time_budget=TIME_BUDGET)
    seconds = time.perf_counter() - started
    got = generator(fast, prompt, s["new"])()
    same = int((got[:, s["prompt"]:] == want[:, s["prompt"]:]).sum())
    gate = QUICK_GATE if size is not None else BENCH_GATE
    m = side_by_side(generator(model, prompt, s["new"]), generator(fast, prompt, s["new"]), gate)
    r = fast.report
    rows = [{"check": "generate (fp32, eval)", "result": f"tokens {same}/{s['new']} equal",
             "figure": f"{m.speedup:.3f}x ±{m.noise:.3f}",
             "detail": f"optimize() {seconds:.0f} s; eager {m.baseline_ms:.1f} ms, optimized "
                       f"{m.candidate_ms:.1f} ms for {s['new']} tokens; kept: "
                       f"{', '.join(r.kept_passes) or 'nothing'}; {r.final.get('reason', '')}"}]
    rows += _block_rows(r, "generate block {}")
    del model, fast
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
    sections = (("optimize (fp32)", lambda: _optimize_rows("fp32", compile=False)),
                ("generate (fp32)", _generate_rows),
                ("optimize (bf16+compile)",
                 lambda: _optimize_rows("bf16+compile", dtype=torch.bfloat16, compile=True)))
    for name, section in sections:  # cheapest first: a run cut short still reports the rest
        before = len(rows)
        try:
            rows += section()
        except Exception as e:  # the table still prints; the failing check says why
            traceback.print_exc()
            rows.append({"check": name, "result": "raised", "detail": f"{type(e).__name__}: {e}"})
        print(table(rows[before:]), flush=True)  # as it goes: a run cut short still says this much
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
