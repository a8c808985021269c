"""A tiny GPT-2 trained for a few steps by the Hugging Face Trainer, with rewriter on: one line.

Random weights from a config and random token ids, on CPU; nothing is downloaded::

    python3 -m pip install -e ".[hf]" && python3 examples/hf_trainer.py

The line that matters is ``callbacks=[RewriterCallback()]``: at the first batch the model is
optimized (with the AdamW the Trainer built, switched to its fused form in place), the Trainer
goes on training on the rewritten graphs, and the report lands in ``<output_dir>/rewriter/``.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from rewriter.integrations.transformers import RewriterCallback

SEQ, VOCAB = 64, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--time-budget", type=float, default=30.0,
                        help="seconds optimize() may spend deciding")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="rewriter-hf-")

    torch.manual_seed(0)
    # attn_implementation="eager": GPT-2's own attention code, which fuse_attention rewrites
    # into SDPA (the default "sdpa" would leave it nothing to do).
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ, attn_implementation="eager"))
    ids = torch.randint(0, VOCAB, (16 * args.steps, SEQ))
    data = [{"input_ids": row, "labels": row} for row in ids]
    training = TrainingArguments(out, max_steps=args.steps, per_device_train_batch_size=4,
                                 learning_rate=1e-3, optim="adamw_torch", logging_steps=1,
                                 save_steps=args.steps // 2, use_cpu=True, report_to="none")

    callback = RewriterCallback(time_budget=args.time_budget)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[callback])
    trainer.train()

    print(callback.report.to_markdown() if callback.report else f"not optimized: {callback.error}")
    checkpoint = os.path.join(out, f"checkpoint-{args.steps // 2}")
    reloaded = GPT2LMHeadModel.from_pretrained(checkpoint)  # a plain GPT-2, mid-run weights
    print(f"\nreport: {os.path.join(out, 'rewriter', 'report.md')}")
    print(f"checkpoint {checkpoint} loads into {type(reloaded).__name__}; "
          f"losses: {[round(h['loss'], 4) for h in trainer.state.log_history if 'loss' in h]}")


if __name__ == "__main__":
    main()
