"""How many graphs the compiled decode form needs, family by family::

    python -m benchmarks.decode_graphs --out benchmarks      # ~1 min on 2 cores

Each causal family of ``benchmarks.families`` (tiny configs, random weights, eval) generates
greedily through ``rewriter.devices.executors.CompiledForward`` (what optimize() keeps when
the compiled generation wins) with a torch.compile backend that counts the graphs Dynamo hands
it and runs them as they are: 8 tokens after a 12-token prompt, then 5 after a 17-token one.
Checked: the tokens are the original model's, the graphs after the first generation (one is
the aim: every decode call at every cache length) and after the second (no new graph at a new
prompt length), and how many calls ran compiled (the decode calls; the prefill runs the
forward uncompiled). No Inductor: what is checked is Dynamo's view, not speed.

Writes ``DECODE_GRAPHS.md`` and ``decode_graphs.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

import torch

from benchmarks.families import COMMON, FAMILIES, MASKED_LM, build
from benchmarks.measure import command_line, machine_info, write_result


class CountingBackend:
    """Counts the graphs it is handed and the calls they serve; runs each as it is."""

    def __init__(self) -> None:
        self.graphs = self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.runs += 1
            return gm(*args)
        return run


def family_row(name: str) -> dict:
    from rewriter.devices.executors import CompiledForward
    torch._dynamo.reset()
    model = build(name).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, COMMON["vocab_size"], (1, n), generator=g) for n in (12, 17)]

    def greedy(prompt: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    want = [greedy(prompts[0], 8), greedy(prompts[1], 5)]
    backend = CountingBackend()
    runner = CompiledForward(model, backend)
    row: dict[str, Any] = {"family": name}
    try:
        with runner.in_place():
            first = greedy(prompts[0], 8)
            row.update(graphs_first=backend.graphs, compiled_calls_first=backend.runs)
            second = greedy(prompts[1], 5)
        row.update(graphs_after_new_length=backend.graphs, compiled_calls=backend.runs,
                   tokens_equal=bool(torch.equal(first, want[0]) and torch.equal(second, want[1])))
    except Exception as e:  # a family the compiled form cannot serve: named, the sweep goes on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Decode graphs per family", "", command_line(result) + f", transformers {m['transformers']}.", "",
             "What: " + " ".join(__doc__.split("\n\n")[2].split()), "",
             "| family | graphs after a generation | after a new prompt length | calls run compiled | "
             "tokens = original |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['family']} | raised: {r['error']} | | | |")
        else:
            lines.append(f"| {r['family']} | {r['graphs_first']} | {r['graphs_after_new_length']} | "
                         f"{r['compiled_calls_first']}, {r['compiled_calls']} | {r['tokens_equal']} |")
    lines += ["", "Calls run compiled: after the first generation (7 decode calls), after both "
              "(4 more). A family with none passes generate() no cache (every call a full forward)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_graphs", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for DECODE_GRAPHS.md and decode_graphs.json")
    p.add_argument("--only", help="comma-separated config class names")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else [n for n in FAMILIES if n not in MASKED_LM]
    command = "python -m benchmarks.decode_graphs" + (f" --only {args.only}" if args.only else "")
    result = {"command": command, "machine": machine_info(),
              "rows": [family_row(n) for n in names]}
    text = markdown(result)
    write_result(args.out, "decode_graphs", result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
