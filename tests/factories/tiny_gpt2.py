"""transformers GPT-2 factories for the offline script (random weights, no download).

    rewriter optimize tests/factories/tiny_gpt2.py:gpt2_train --train --out out/

``gpt2_train`` is test-sized; ``gpt2_bench`` is big enough for the gate's timings to mean
something on a CPU (used by hand to time measuring against replaying a plan).
"""
from __future__ import annotations

import torch
import transformers


def _gpt2(layers: int, width: int, heads: int, seq: int, batch: int, vocab: int = 256):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                                  n_positions=seq, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}  # labels: the output carries .loss


def gpt2_train():
    """One layer, width 32, 2x16 tokens: the tests' size (Dynamo's compile time grows with
    the number of layers)."""
    return _gpt2(layers=1, width=32, heads=2, seq=16, batch=2)


def gpt2_bench():
    """Four layers, width 256, 4x256 tokens: attention-bound enough to measure on a CPU."""
    return _gpt2(layers=4, width=256, heads=4, seq=256, batch=4)
