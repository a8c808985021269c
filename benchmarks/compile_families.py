"""The compile decision on transformers families the speed benchmarks do not name, at their size,
each family cold in a fresh process of its own::

    python -m benchmarks.compile_families --out benchmarks          # ~5 min on 2 cores
    python -m benchmarks.compile_families --only Qwen2Config,OPTConfig
    python -m benchmarks.compile_families --bf16 --out benchmarks   # optimize(dtype=bf16, ...)

Each family (config classes of ``benchmarks.families``) is built at the size of
``benchmarks.models``' transformers: 4 layers, hidden 256, 4 heads, vocabulary 8000, random
weights, dropout 0; batch 4 x 256 tokens. Training, AdamW, ``optimize(steps=20000)`` otherwise
at its defaults (``compile="auto"``: the compile is weighed against the run), in a new process
with an empty Inductor cache and no knowledge base: what a user pays the first time. The row:
the capture, what was kept, the compile row (kept or rejected with its speedup over the
rewritten eager step, not tried, or failed verification, and why), optimize()'s seconds and
their compile phase. What is checked is that the regional compile verifies and decides on
models the tuning never saw, and what it costs; the peers are not run here (``benchmarks.run``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

# benchmarks.models' transformer size, in each config's own names where they differ
SIZE = dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
            attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES: dict[str, dict] = {
    "Qwen2Config": {}, "MistralConfig": {}, "Phi3Config": {}, "GPTNeoXConfig": {},
    "GemmaConfig": dict(head_dim=64), "OPTConfig": dict(ffn_dim=688, word_embed_proj_dim=256),
    "DistilBertConfig": dict(dim=256, hidden_dim=1024, n_layers=4, n_heads=4),
}
BATCH, TOKENS, STEPS = 4, 256, 20_000


def build(name: str):
    """The family's model at the benchmark size, training mode, dropout 0."""
    import torch
    import transformers

    from benchmarks.families import MASKED_LM

    cfg = getattr(transformers, name)(**{**SIZE, **FAMILIES[name]})
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if name in MASKED_LM else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def one_family(name: str, bf16: bool = False) -> dict:
    """In this process: optimize(steps=STEPS) on the family (``bf16``: with dtype=bfloat16, where
    the compile candidate is the original model under autocast, its blocks nested); its row."""
    import torch

    import rewriter

    model = build(name)
    ids = torch.randint(3, SIZE["vocab_size"], (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
    started = time.perf_counter()
    fast, _ = rewriter.optimize(model, {"input_ids": ids, "labels": ids},
                                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                steps=STEPS, progress=False, knowledge_base=False,
                                dtype=torch.bfloat16 if bf16 else None)
    seconds = time.perf_counter() - started
    r = fast.report
    compile_rows = [{"status": d.status, "speedup": d.speedup, "reason": d.reason}
                    for d in r.decisions if d.pass_name == "compile"]
    return {"family": name.removesuffix("Config"), "capture": r.front_end, "kept": r.kept_passes,
            "compile": compile_rows, "optimize_s": round(seconds, 1),
            "compile_s": round(r.phases.get("compile", 0.0), 1),
            "failed": [f"{d.pass_name}: {d.reason}" for d in r.decisions if "fail" in d.status]}


def cold(name: str, bf16: bool = False) -> dict:
    """:func:`one_family` in a fresh process with an empty Inductor cache; a process that fails
    is a row with its error."""
    from benchmarks.measure import result_in_fresh_process

    return result_in_fresh_process([sys.executable, "-m", "benchmarks.compile_families", "--one", name]
                                   + (["--bf16"] if bf16 else []), {"family": name.removesuffix("Config")})


def _compile_cell(rows: list[dict]) -> str:
    """The tried compile's verdict (a not-tried row only when nothing was tried)."""
    tried = [c for c in rows if c["status"] != "not tried"] or rows
    if not tried:
        return "-"
    c = tried[0]
    figure = f" {c['speedup']:.3f}x" if c.get("speedup") else ""
    detail = "" if c["status"] in ("kept", "rejected") else f": {c['reason'][:160]}"
    first = " (decided first)" if c["reason"].startswith(("decided first", "slower than the original step")) else ""
    return f"{c['status']}{figure}{first}{detail}"


def markdown(rows: list[dict], command: str, machine: dict, bf16: bool = False) -> str:
    from benchmarks.measure import error_line, machine_line

    lines = ["# The compile decision on families the speed benchmarks do not name", "",
             f"Command: `{command}`", "",
             machine_line(machine), "",
             f"Training, AdamW, `optimize(steps={STEPS}{', dtype=torch.bfloat16' if bf16 else ''})`, each family in a fresh process with an empty "
             f"Inductor cache and no knowledge base; 4 layers, hidden 256, vocabulary 8000, batch "
             f"{BATCH} x {TOKENS}. Compile: over the rewritten eager step, side by side in that process "
             "(decided first, rewriter.decide.compile_first: over the eager step under autocast, then "
             "checked against the original step).", "",
             "| family | capture | compile | kept | optimize() s | of it, compile s | failed verification |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | failed | | | | | {error_line(r['error'])} |")
            continue
        lines.append(f"| {r['family']} | {r['capture']} | {_compile_cell(r['compile'])} | "
                     f"{', '.join(r['kept']) or '-'} | {r['optimize_s']} | {r['compile_s']} | "
                     f"{'; '.join(f[:120] for f in r['failed']) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_families",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated config class names (default: all)")
    p.add_argument("--out", help="folder for COMPILE_FAMILIES.md and compile_families.json")
    p.add_argument("--bf16", action="store_true", help="optimize(dtype=torch.bfloat16, ...) (files *_bf16)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_family(args.one, args.bf16)))
        return 0
    names = args.only.split(",") if args.only else list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    from benchmarks.measure import machine_info, write_result

    rows = []
    for name in names:
        rows.append(cold(name, args.bf16))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    command = "python -m benchmarks.compile_families" + (" --bf16" if args.bf16 else "") + \
        (f" --only {args.only}" if args.only else "")
    machine = machine_info()
    text = markdown(rows, command, machine, args.bf16)
    write_result(args.out, "compile_families" + ("_bf16" if args.bf16 else ""),
                 {"command": command, "machine": machine, "rows": rows}, text)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
