"""optimize() on transformers families the tests do not name, one after another in one process::

    python -m benchmarks.families --out benchmarks                  # ~6 min on 2 cores
    python -m benchmarks.families --dtype bf16 --out /tmp/f         # with optimize(dtype=bf16)
    python -m benchmarks.families --checkpointing --only LlamaConfig,GPT2Config
    python -m benchmarks.families --dtype bf16 --steps 20000 --out /tmp/f  # a long run: the compile paths

Each family is built from a tiny config (2 layers, hidden 128, vocabulary 1000, random weights,
transformers' own defaults otherwise: dropout where the family has it) and trained: optimize()
with AdamW on 2x64 tokens (afresh: no knowledge base), then three steps of the optimized model
beside three of an untouched copy, each pair from the same seed: the largest loss difference.
A causal LM is also optimized in eval on a 1x12 prompt and generates 8 greedy tokens, against
the original's. What is checked is robustness, not speed: the capture (regional, by block, or
the whole model, and why), the graphs, what was kept and what failed verification, and that
the numbers are the model's. All families run in one process, as a sweep or a notebook would
(Dynamo's per-code-object cache is shared by them: rewriter.capture.code_entries).

Writes ``FAMILIES.md`` and ``families.json`` (``families_bf16.*``, ``families_checkpointing.*``).
"""
from __future__ import annotations

import argparse
import copy
import time
import traceback
from typing import Any, Sequence

import torch

from benchmarks.measure import command_line, machine_info, write_result

COMMON = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Config class -> what it needs beside COMMON (its own names for the sizes, expert counts)
FAMILIES: dict[str, dict] = {
    "LlamaConfig": {}, "MistralConfig": {}, "Qwen2Config": {}, "Qwen3Config": dict(head_dim=32),
    "GemmaConfig": dict(head_dim=32), "Gemma2Config": dict(head_dim=32),
    "Gemma3TextConfig": dict(head_dim=32), "Phi3Config": {}, "GPTNeoXConfig": {},
    "OPTConfig": dict(ffn_dim=256, word_embed_proj_dim=128),
    "MixtralConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=128),
    "Qwen3MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "StableLmConfig": {}, "CohereConfig": {}, "OlmoConfig": {}, "Olmo2Config": {},
    "GraniteConfig": {}, "SmolLM3Config": {}, "Starcoder2Config": {}, "GlmConfig": dict(head_dim=32),
    "HeliumConfig": dict(head_dim=32), "PersimmonConfig": {},
    "GPT2Config": dict(n_embd=128, n_layer=2, n_head=4, n_positions=256),
    "GPTBigCodeConfig": dict(n_embd=128, n_layer=2, n_head=4, n_positions=256),
    "CodeGenConfig": dict(n_embd=128, n_layer=2, n_head=4, n_positions=256, rotary_dim=16),
    "MptConfig": dict(d_model=128, n_layers=2, n_heads=4, max_seq_len=256),
    "BertConfig": {}, "RobertaConfig": {}, "ElectraConfig": dict(embedding_size=128),
    "DistilBertConfig": dict(dim=128, hidden_dim=256, n_layers=2, n_heads=4),
    "ModernBertConfig": dict(global_attn_every_n_layers=1),
    # BartForCausalLM: F.dropout in the forward that loops over the layers
    "BartConfig": dict(decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=256,
                       encoder_ffn_dim=256),
}
MASKED_LM = {"BertConfig", "RobertaConfig", "ElectraConfig", "DistilBertConfig", "ModernBertConfig"}
STEPS, NEW_TOKENS = 3, 8


def build(name: str, checkpointing: bool = False) -> torch.nn.Module:
    import transformers
    cfg = getattr(transformers, name)(**{**COMMON, **FAMILIES[name]})
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if name in MASKED_LM else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg).train()
    if checkpointing:
        model.config.use_cache = False  # as transformers sets it under checkpointing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _blocks(report: Any) -> str:
    return "; ".join(f"{b['class']} x{b['instances']}: {', '.join(b.get('passes', [])) or 'none'}"
                     for b in report.blocks) or "-"


def train_row(name: str, dtype: torch.dtype | None, checkpointing: bool, steps: int | None = None) -> dict:
    import rewriter
    model = build(name, checkpointing)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    started = time.perf_counter()
    fast, opt = rewriter.optimize(model, inputs, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  dtype=dtype, progress=False, knowledge_base=False, steps=steps,
                                  # a long run: optimize()'s own budget, which a compile may use
                                  **({} if steps else {"time_budget": 30}))
    seconds = time.perf_counter() - started
    r = fast.report
    worst = 0.0
    for step in range(STEPS):
        losses = []
        for m, o in ((ref, ref_opt), (fast, opt)):
            torch.manual_seed(100 + step)  # the same dropout draws for both
            loss = m(**inputs).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
    return {"capture": r.front_end, "why": r.front_end_reason, "graphs": r.graphs, "blocks": _blocks(r),
            "kept": r.kept_passes, "failed": [f"{d.pass_name}: {d.reason}" for d in r.decisions
                                              if "fail" in d.status],
            "compile": [f"{d.status}: {d.reason}" for d in r.decisions if d.pass_name == "compile"],
            "whole_step": r.final.get("reason", ""), "optimize_s": round(seconds, 1),
            "max_loss_difference": worst, "notes": list(r.notes)}


def generate_row(name: str, dtype: torch.dtype | None) -> dict:
    import rewriter
    model = build(name).eval()
    prompt = torch.randint(3, COMMON["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))

    def greedy(m: Any) -> torch.Tensor:
        with torch.no_grad():
            return m.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    want = greedy(model)
    fast = rewriter.optimize(copy.deepcopy(model), example_inputs=(prompt,), dtype=dtype, progress=False,
                             knowledge_base=False, time_budget=30)
    got = greedy(fast)
    same = int((got[:, prompt.shape[1]:] == want[:, prompt.shape[1]:]).sum())
    return {"generate_tokens_equal": f"{same}/{NEW_TOKENS}", "generate_step": fast.report.workload,
            "generate_kept": fast.report.kept_passes}


def run(names: Sequence[str], dtype: torch.dtype | None, checkpointing: bool,
        steps: int | None = None) -> list[dict]:
    rows = []
    for name in names:
        row: dict = {"family": name.removesuffix("Config")}
        try:
            row.update(train_row(name, dtype, checkpointing, steps))
            if name not in MASKED_LM and not checkpointing:
                row.update(generate_row(name, dtype))
            row["error"] = None
        except Exception as e:  # the sweep goes on; the row says what raised
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(row, flush=True)
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    lines = ["# optimize() across transformers families", "", command_line(result) + ".", "",
             f"{result['what']}", "",
             "| family | capture | graphs | blocks: kept in the block | kept | failed verification | "
             "max loss difference | generate tokens = original | optimize() s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"| {r['family']} | raised: {r['error'][:200]} | | | | | | | |")
            continue
        lines.append(f"| {r['family']} | {r['capture']} | {r['graphs']} | {r['blocks']} | "
                     f"{', '.join(r['kept']) or '-'} | {'; '.join(f[:120] for f in r['failed']) or '-'} | "
                     f"{r['max_loss_difference']:.1e} | {r.get('generate_tokens_equal', '-')} | "
                     f"{r['optimize_s']} |")
    compiles = [r for r in result["rows"] if not r["error"] and r.get("compile")
                and not any(c.startswith("kept") for c in r["compile"])]
    if compiles:  # --steps: where a compile was weighed and not kept, why
        lines += ["", "Compile not kept: " + "; ".join(f"{r['family']}: {r['compile'][-1][:300]}" for r in compiles)]
    whole = [r for r in result["rows"] if not r["error"] and r["capture"] != "regional"]
    if whole:
        lines += ["", "Captured whole, and why: " + "; ".join(f"{r['family']}: {r['why']}"
                                                              + (f" ({r['notes'][0]})" if r["notes"] else "")
                                                              for r in whole)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.families", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--checkpointing", action="store_true", help="transformers' gradient checkpointing on")
    p.add_argument("--only", help="comma-separated config class names (default: all)")
    p.add_argument("--steps", type=int, help="optimize(steps=N) in training: the run's length, so a "
                                             "compile is weighed (and, where it repays, paid)")
    p.add_argument("--out", help="folder for FAMILIES.md and families.json")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    rows = run(names, dtype, args.checkpointing, args.steps)
    command = "python -m benchmarks.families" + (" --dtype bf16" if dtype else "") + \
        (" --checkpointing" if args.checkpointing else "") + (f" --steps {args.steps}" if args.steps else "") + \
        (f" --only {args.only}" if args.only else "")
    what = (f"Training: optimize() with AdamW{' and dtype=bf16' if dtype else ''}"
            f"{f', steps={args.steps}' if args.steps else ''}"
            f"{', gradient checkpointing on' if args.checkpointing else ''}, then {STEPS} steps beside "
            f"an untouched copy (same seeds). Generation: {NEW_TOKENS} greedy tokens after a 1x12 prompt.")
    result = {"command": command, "machine": machine_info(), "what": what, "rows": rows}
    text = markdown(result)
    stem = "families" + ("_bf16" if dtype else "") + ("_checkpointing" if args.checkpointing else "") + \
        (f"_steps{args.steps}" if args.steps else "")
    write_result(args.out, stem, result, text)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
