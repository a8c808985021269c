"""FSDP2 in both orders on two CPU ranks (gloo): what optimize() keeps, on every rank, and the losses.

    python -m benchmarks.fsdp --out benchmarks          # ~5 min on 2 cores
    python -m benchmarks.fsdp --layers 2 --steps 2 --out /tmp/f

The zoo's LLaMA config (hidden 256, ``--layers`` decoder layers, 2 x 256 tokens a rank, fp32
training, plain AdamW), measured for real (no controlled clock), afresh (no knowledge base):

- plain: optimize() of the model in one process, no process group (what it keeps undistributed);
- optimize, then ``fully_shard`` each decoder layer and the root (rank 0 decides, rank 1 replays);
- ``fully_shard``, then optimize() (every rank gathers the parameters once, rank 0 decides on
  them, rank 1 replays; ``rewriter.devices.gathered``).

Each distributed run then trains ``--steps`` steps through the optimized model and, in the same
processes, an eager FSDP2 copy with the same initial weights and the same data (different data
on each rank): the table gives the kept rewrites on each rank, whether any fell back, the block
graphs' runs, and the largest loss difference step by step. Each rank runs one thread (two
ranks share the two cores). Writes ``FSDP.md`` and ``fsdp.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Sequence

import torch

from benchmarks.measure import command_line, machine_info, write_result

WORLD = 2
HIDDEN, BATCH, SEQ, VOCAB = 256, 2, 256, 8000


def _say(msg: str) -> None:
    print(f"[fsdp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _model(layers: int) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)  # the same weights in every process
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=(8 * HIDDEN // 3 + 63) // 64 * 64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        attention_dropout=0.0, attn_implementation="eager", use_cache=False)
    return transformers.LlamaForCausalLM(config).train()


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _optimize(model: torch.nn.Module) -> tuple[Any, Any, float]:
    import rewriter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    started = time.perf_counter()
    fast, opt = rewriter.optimize(model, _batch(1), optimizer=opt, progress=False, profile=False,
                                  knowledge_base=False, compile=False)
    return fast, opt, time.perf_counter() - started


def _summary(fast: Any, seconds: float) -> dict[str, Any]:
    r = fast.report
    return {"kept": r.kept_passes, "seconds": round(seconds, 1), "front_end": r.front_end,
            "statuses": {d.pass_name: d.status for d in r.decisions
                         if d.status not in ("not applicable", "no sites")},
            "blocks": [(b["class"], b["instances"]) for b in (r.blocks or [])],
            "final": r.final.get("reason", ""), "notes": list(r.notes)}


def plain_run(layers: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    fast, _, seconds = _optimize(_model(layers))
    out = _summary(fast, seconds)
    fast.restore()
    return out


def _train(run: Any, model: torch.nn.Module, opt: Any, steps: int, rank: int) -> list[float]:
    losses = []
    for i in range(steps):
        loss = run(**_batch(100 + 10 * i + rank)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _what_runs(outcome: Any) -> str:
    if not outcome.kept:
        return "the original (no graph rewrite kept)"
    if outcome.use_original:  # hooks added outside the blocks after optimize(): FSDP2's on the root
        return "rewritten blocks inside the model's own code"
    return "rewritten blocks and outer graphs"


def _rank(rank: int, port: int, order: str, layers: int, steps: int, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    try:
        model = _model(layers)
        eager = _shard(copy.deepcopy(model))
        if order == "shard_then_optimize":
            _shard(model)
        fast, opt, seconds = _optimize(model)
        if order == "optimize_then_shard":
            _shard(model)
            opt = type(opt)(model.parameters(), **{k: v for k, v in opt.defaults.items()
                                                  if k in ("lr", "fused", "foreach")})
        cap = fast._outcome.capture
        runs = lambda: sum(s.runs for s in cap.slots if s.block) if cap is not None else 0  # noqa: E731
        before = runs()
        losses = _train(fast, model, opt, steps, rank)
        result = {**_summary(fast, seconds), "rank": rank, "losses": losses,
                  "runs": _what_runs(fast._outcome),
                  "block_graph_runs": runs() - before,
                  "eager_losses": _train(eager, eager, torch.optim.AdamW(eager.parameters(), lr=1e-4,
                                                                         foreach=False), steps, rank)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see tests/ranks.py: gloo's worker threads abort a normal interpreter exit


def distributed_run(order: str, layers: int, steps: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(port, order, layers, steps, out_dir), nprocs=WORLD,
                           join=True, start_method="spawn")
        return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fsdp", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    command = "python -m benchmarks.fsdp " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {"machine": machine_info(), "command": command, "layers": args.layers,
                              "steps": args.steps}
    _say("plain model, one process")
    result["plain"] = plain_run(args.layers)
    for order in ("optimize_then_shard", "shard_then_optimize"):
        _say(order.replace("_", " "))
        result[order] = distributed_run(order, args.layers, args.steps)
    write_result(args.out, "fsdp", result, to_markdown(result))
    return 0


def to_markdown(result: dict[str, Any]) -> str:
    lines = [command_line(result), "",
             f"LLaMA config, {result['layers']} layers, hidden {HIDDEN}, {BATCH} x {SEQ} tokens a rank, "
             f"fp32 training (AdamW), two gloo ranks of one thread each, {result['steps']} steps.", "",
             "| run | rank | optimize() s | kept | what runs | rewritten block graph runs | max loss diff vs eager FSDP2 |",
             "|---|---|---|---|---|---|---|"]
    plain = result["plain"]
    lines.append(f"| plain (no process group) | - | {plain['seconds']} | {', '.join(plain['kept']) or '-'} | - | - | - |")
    for order in ("optimize_then_shard", "shard_then_optimize"):
        for r in result.get(order, []):
            diff = max(abs(a - b) for a, b in zip(r["losses"], r["eager_losses"]))
            lines.append(f"| {order.replace('_', ' ')} | {r['rank']} | {r['seconds']} | "
                         f"{', '.join(r['kept']) or '-'} | {r['runs']} | "
                         f"{r['block_graph_runs']} | {diff:.2e} |")
    lines += ["", "Rank 0 decides (measured), rank 1 replays its plan. *What runs*: optimize() then "
              "fully_shard adds FSDP2's hooks to the root after optimize(), so the model's own code "
              "runs around the blocks, whose installed rewrites still run (README, Regional "
              "rewriting); sharded first, the hooks were there when the outer graphs were "
              "captured. fuse_optimizer is decided only in the first order (in the second the "
              "optimizer holds the shards).", ""]
    for order in ("optimize_then_shard", "shard_then_optimize"):
        for r in result.get(order, []):
            lines.append(f"- {order.replace('_', ' ')}, rank {r['rank']}: losses "
                         f"{[round(x, 5) for x in r['losses']]}, eager FSDP2 {[round(x, 5) for x in r['eager_losses']]}")
    for r in [plain] + result.get("shard_then_optimize", [])[:1]:
        lines.append(f"- statuses{' (plain)' if r is plain else ' (shard then optimize, rank 0)'}: {r['statuses']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
