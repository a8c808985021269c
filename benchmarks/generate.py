"""Generation: greedy ``generate()`` through optimize()'s model, beside eager and the transformers
recipe (static cache + ``torch.compile(model.forward)``), side by side in one process::

    python -m benchmarks.generate --out benchmarks           # ~4 min on 2 cores
    python -m benchmarks.generate --dtype bf16 --out /tmp/g  # the same in bf16 weights
    python -m benchmarks.generate --quick                    # tiny sizes: the script runs

Rows: ``static_compile`` (the recipe), ``optimize`` (defaults), ``optimize_serving``
(``steps=100000``: a compile is weighed against a server's calls). The model is the one issue 32
measured: a Qwen2 config, 3 layers, hidden 384, 8000 words, random weights, eval mode, a
1x32-token prompt and 48 new tokens (``--model llama`` / ``gpt2``: the same sizes in those
architectures). Each configuration is timed
against eager, interleaved (``benchmarks.measure.side_by_side``: the median of paired ratios and
its noise) on two calls: ``generate(max_new_tokens=1)`` (the prefill, and one token picked) and
``generate(max_new_tokens=48)``. Prefill tokens/s is the prompt over the first; decode tokens/s
is the 47 further tokens over the difference of the two medians. Also: each configuration's
one-time cost (optimize(), or the recipe's first call, its compile), the first call at a
prompt length it never saw (13 tokens longer), and whether its tokens are eager's. Inductor's
cache is a fresh folder of the run's own (cold for the recipe, which compiles first; the
process is warm by the time optimize() compiles); the recipe's and ``optimize_serving``'s
one-time costs are also taken each in a fresh process of its own, cold (``--cold NAME``).

Writes ``GENERATE.md`` and ``generate.json`` (``generate_bf16.*`` for bf16) into ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from benchmarks.measure import (BENCH_GATE, QUICK_GATE, in_fresh_process, isa_text, machine_info,
                                side_by_side, write_result)

NEW_TOKENS = 48
SERVING_CALLS = 100_000  # generate() calls a serving process expects (optimize(steps=))
SIZES = {"default": dict(layers=3, hidden=384, inter=1024, heads=6, kv=2, vocab=8000, prompt=32),
         "quick": dict(layers=2, hidden=64, inter=128, heads=4, kv=2, vocab=256, prompt=8)}


ARCHITECTURES = ("qwen2", "llama", "gpt2")  # --model: the Qwen2, and two more families


def build_model(size: dict, dtype: torch.dtype, arch: str = "qwen2") -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    if arch == "gpt2":  # no grouped keys and values: as many heads as the others' queries
        cfg = transformers.GPT2Config(n_layer=size["layers"], n_embd=size["hidden"], n_inner=size["inter"],
                                      n_head=size["heads"], vocab_size=size["vocab"], n_positions=512,
                                      attn_implementation="eager")
    else:
        config = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
        cfg = config(num_hidden_layers=size["layers"], hidden_size=size["hidden"],
                     intermediate_size=size["inter"], num_attention_heads=size["heads"],
                     num_key_value_heads=size["kv"], vocab_size=size["vocab"],
                     max_position_embeddings=512, attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(cfg).eval().to(dtype)


def generator(model: Any, prompt: torch.Tensor, new_tokens: int, **kw: Any) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, **kw)
        if prompt.device.type == "cuda":
            torch.cuda.synchronize()  # a wall clock times the device's work too
        return out
    return run


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def _recipe(model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    recipe = copy.deepcopy(model)
    recipe.forward = torch.compile(recipe.forward)
    _, first = timed(generator(recipe, prompt, NEW_TOKENS, cache_implementation="static"))
    return {"model": recipe, "kwargs": {"cache_implementation": "static"}, "one_time_s": first,
            "what": "transformers' static cache + torch.compile(model.forward) (first call)"}


def _optimize(model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    import rewriter
    own = copy.deepcopy(model)
    fast, seconds = timed(lambda: rewriter.optimize(own, example_inputs=(prompt,), knowledge_base=False,
                                                    progress=False))
    return {"model": fast, "kwargs": {}, "one_time_s": seconds, "report": fast.report,
            "what": "rewriter.optimize() defaults, afresh (optimize() seconds)"}


def _serving(model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    import rewriter
    own = copy.deepcopy(model)
    fast, seconds = timed(lambda: rewriter.optimize(own, example_inputs=(prompt,), knowledge_base=False,
                                                    progress=False, steps=SERVING_CALLS, time_budget=None))
    return {"model": fast, "kwargs": {}, "one_time_s": seconds, "report": fast.report,
            "what": f"rewriter.optimize(steps={SERVING_CALLS}, time_budget=None): a server's many calls, "
                    "so a compile that repays within them is tried (optimize() seconds, compile included)"}


# name -> how the configuration is built; its one-time cost is what building it took
CONFIGS: dict[str, Callable[[torch.nn.Module, torch.Tensor], dict]] = {
    "static_compile": _recipe, "optimize": _optimize, "optimize_serving": _serving}
# the configurations whose one-time cost is also taken in a process of its own, cold (in the
# run's process, the recipe compiles first and leaves Inductor loaded and its ISA checks done)
COLD = ("static_compile", "optimize_serving")


def configurations(model: torch.nn.Module, prompt: torch.Tensor) -> dict[str, dict]:
    """name -> {"model", "kwargs" for generate, "one_time_s", "what"}; each its own copy."""
    return {name: build(model, prompt) for name, build in CONFIGS.items()}


def cold_one_time(name: str, argv: Sequence[str]) -> float | None:
    """Configuration ``name``'s one-time cost in a fresh Python process with an empty Inductor
    cache of its own (``argv``: this run's size, dtype and device options); None, with the
    child's last words printed, when that process fails (the run's other figures stand)."""
    out = in_fresh_process([sys.executable, "-m", "benchmarks.generate", "--cold", name, *argv])
    if out.returncode != 0:
        print(f"cold one-time of {name} failed (exit {out.returncode}): {out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["one_time_s"]


def _input(size: dict, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, size["vocab"], (1, size["prompt"]), generator=g).to(device)
    other = torch.randint(0, size["vocab"], (1, size["prompt"] + 13), generator=g).to(device)
    return prompt, other


def run(size_name: str, dtype: torch.dtype, quick: bool, device: str = "cpu",
        cold: Sequence[str] | None = None, arch: str = "qwen2") -> dict:
    """The rows; ``cold``: this run's options, to take the cold one-time costs with (None: not
    taken)."""
    size = SIZES[size_name]
    model = build_model(size, dtype, arch).to(device)
    prompt, other = _input(size, device)
    want = generator(model, prompt, NEW_TOKENS)()
    gate = QUICK_GATE if quick else BENCH_GATE
    eager_prefill, eager_gen = generator(model, prompt, 1), generator(model, prompt, NEW_TOKENS)
    rows = []
    for name, c in configurations(model, prompt).items():
        m, kw = c["model"], c["kwargs"]
        got = generator(m, prompt, NEW_TOKENS, **kw)()
        same = int((got[:, size["prompt"]:] == want[:, size["prompt"]:]).sum())
        _, new_length_s = timed(generator(m, other, NEW_TOKENS, **kw))
        pre = side_by_side(eager_prefill, generator(m, prompt, 1, **kw), gate)
        gen = side_by_side(eager_gen, generator(m, prompt, NEW_TOKENS, **kw), gate)
        row = {"config": name, "what": c["what"], "one_time_s": round(c["one_time_s"], 1),
               "cold_one_time_s": _rounded(cold_one_time(name, cold)) if name in COLD and cold is not None else None,
               "new_length_first_call_s": round(new_length_s, 2),
               "tokens_equal_to_eager": f"{same}/{NEW_TOKENS}",
               "prefill_speedup": round(pre.speedup, 3), "prefill_noise": round(pre.noise, 3),
               "generate_speedup": round(gen.speedup, 3), "generate_noise": round(gen.noise, 3),
               "eager_prefill_tok_s": round(size["prompt"] / (pre.baseline_ms / 1e3), 1),
               "prefill_tok_s": round(size["prompt"] / (pre.candidate_ms / 1e3), 1),
               "eager_decode_tok_s": _decode_rate(gen.baseline_ms, pre.baseline_ms),
               "decode_tok_s": _decode_rate(gen.candidate_ms, pre.candidate_ms)}
        if "report" in c:
            r = c["report"]
            compiled = [d.reason for d in r.decisions if d.pass_name == "compile"]
            row.update(kept=r.kept_passes, workload=r.workload, whole_model=r.final.get("reason", ""),
                       block_graphs=[b["graphs"] for b in r.blocks], compile=compiled[0] if compiled else "")
        rows.append(row)
    machine = machine_info()
    if device == "cuda":
        machine["cpu"] = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), host {machine['cpu']}"
    return {"machine": machine, "dtype": str(dtype).replace("torch.", ""),
            "model": f"{type(model.config).__name__.replace('Config', '')} config, {size['layers']} layers, hidden {size['hidden']}, vocabulary "
                     f"{size['vocab']}, random weights, eval; prompt 1x{size['prompt']}, {NEW_TOKENS} new tokens",
            "rows": rows}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def _decode_rate(gen_ms: float, prefill_ms: float) -> float | None:
    extra = gen_ms - prefill_ms
    return round((NEW_TOKENS - 1) / (extra / 1e3), 1) if extra > 0 else None


def markdown(result: dict, command: str) -> str:
    m = result["machine"]
    lines = [f"# Generation ({result['dtype']})", "",
             f"`{command}` — {result['model']}.", "",
             f"Machine: {m['cpu']} ({isa_text(m)}), {m['cpu_count']} cores, torch {m['torch']}, "
             f"transformers {m['transformers']}, {m['date']}; load at start {m['load_average_at_start']}.", "",
             "Speedups over eager generate() in the same process (median of interleaved pairs ± noise).", "",
             "| config | one-time s | one-time s, cold process | new length first call s | tokens = eager | "
             "prefill | generate 48 | prefill tok/s (eager) | decode tok/s (eager) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cold = r.get("cold_one_time_s")
        lines.append(f"| {r['config']} | {r['one_time_s']} | {'-' if cold is None else cold} | "
                     f"{r['new_length_first_call_s']} | "
                     f"{r['tokens_equal_to_eager']} | {r['prefill_speedup']}x ±{r['prefill_noise']} | "
                     f"{r['generate_speedup']}x ±{r['generate_noise']} | {r['prefill_tok_s']} "
                     f"({r['eager_prefill_tok_s']}) | {r['decode_tok_s']} ({r['eager_decode_tok_s']}) |")
    lines += ["", "One-time s: in this process, after the rows above it (the recipe, first, pays Inductor's "
              "import and ISA checks for all); cold process: the configuration alone in a fresh process "
              "with an empty Inductor cache (`python -m benchmarks.generate --cold NAME`).", ""]
    lines += [f"- {r['config']}: {r['what']}" for r in result["rows"]]
    for r in result["rows"]:
        if "workload" in r:
            lines += [f"- {r['config']}: step: {r['workload'] or 'one call'}; kept: "
                      f"{', '.join(r['kept']) or 'nothing'}; whole model: {r['whole_model']}; "
                      f"compile: {r.get('compile') or 'no row'}; block graphs: {r['block_graphs']}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few pairs (checks the script runs)")
    p.add_argument("--out", help="folder for GENERATE.md and generate.json")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda (files get a _cuda suffix)")
    p.add_argument("--cold", choices=tuple(CONFIGS), help="only build this configuration, in this "
                   "process, and print its one-time seconds as JSON (what the cold column runs)")
    p.add_argument("--model", choices=ARCHITECTURES, default="qwen2",
                   help="the architecture (same sizes; files get a _<model> suffix but for qwen2)")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    size = SIZES["quick" if args.quick else "default"]
    if args.cold:
        model = build_model(size, dtype, args.model).to(args.device)
        built = CONFIGS[args.cold](model, _input(size, args.device)[0])
        print(json.dumps({"one_time_s": built["one_time_s"]}))
        return 0
    options = ["--dtype", args.dtype, "--device", args.device, "--model", args.model] + \
        (["--quick"] if args.quick else [])
    # a cold Inductor cache of this run's own: the recipe's first call is its compile
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="generate_inductor_")
    result = run("quick" if args.quick else "default", dtype, args.quick, args.device, cold=options,
                 arch=args.model)
    command = "python -m benchmarks.generate" + (" --dtype bf16" if args.dtype == "bf16" else "") + \
        (" --quick" if args.quick else "") + (f" --device {args.device}" if args.device != "cpu" else "") + \
        (f" --model {args.model}" if args.model != "qwen2" else "")
    text = markdown(result, command)
    stem = "generate" + ("_bf16" if args.dtype == "bf16" else "") + \
        (f"_{args.device}" if args.device != "cpu" else "") + (f"_{args.model}" if args.model != "qwen2" else "")
    write_result(args.out, stem, result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
