"""A tiny attention model trained for a few steps by Lightning, with rewriter on: one line.

Random weights and random data, on CPU; nothing is downloaded::

    python3 -m pip install -e ".[lightning]" && python3 examples/lightning_trainer.py

The line that matters is ``callbacks=[RewriterCallback()]``: at the first batch the module's
``training_step`` is optimized (with the optimizer ``configure_optimizers`` returned, switched to
its fused form in place), Lightning goes on training on the rewritten graphs, and the report
lands in ``<default_root_dir>/rewriter/``.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from rewriter.integrations.lightning import RewriterCallback

SEQ, DIM, HEADS, VOCAB = 64, 64, 4, 256


class TinyLM(L.LightningModule):
    """Embedding, one hand-written causal attention block, an MLP and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("causal", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(DIM, dim=-1)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))  # (B, heads, T, hd)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        x = x + self.proj((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, c))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=False)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="root directory (default: a temporary one)")
    parser.add_argument("--time-budget", type=float, default=30.0,
                        help="seconds optimize() may spend deciding")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="rewriter-lightning-")

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (8 * args.steps, SEQ + 1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

    callback = RewriterCallback(time_budget=args.time_budget)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, default_root_dir=out, callbacks=[callback])
    trainer.fit(TinyLM(), train_dataloaders=loader)

    print(callback.report.to_markdown() if callback.report else f"not optimized: {callback.error}")
    checkpoints = os.path.join(out, "checkpoints")  # Lightning's own, without a logger
    saved = os.path.join(checkpoints, sorted(os.listdir(checkpoints))[-1])
    fresh = TinyLM()
    fresh.load_state_dict(torch.load(saved, weights_only=True)["state_dict"])  # the plain class
    print(f"\nreport: {os.path.join(out, 'rewriter', 'report.md')}")
    print(f"checkpoint {saved} loads into {type(fresh).__name__}; "
          f"last loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
