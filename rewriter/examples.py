"""Built-in example models: what ``rewriter demo`` optimizes, and small cases for the docs.

``TunedBlock`` carries the NPU tuning guide's two classic hot spots, written the way models
in the wild write them:

* the MatMul case study: an input of 1024 features times a weight transposed on the fly to
  256 outputs (``[256,1024] x [1024,256]``), plus a separate bias add;
* attention written out by hand: ``softmax(q @ k^T / sqrt(d) + causal mask) @ v``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class TunedBlock(nn.Module):
    def __init__(self, in_features: int = 1024, hidden: int = 256, heads: int = 4,
                 max_len: int = 256) -> None:
        super().__init__()
        self.heads = heads
        self.w_in = nn.Parameter(torch.randn(hidden, in_features) / math.sqrt(in_features))
        self.b_in = nn.Parameter(torch.zeros(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(x, self.w_in.t()) + self.b_in          # (B, T, hidden)
        b, t, c = h.shape
        q, k, v = self.qkv(h).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)   # (B, heads, T, T)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


def tuned_block(batch: int = 4, seq: int = 256) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The demo's (model, example_inputs): TunedBlock in inference, seeded for repeatability."""
    torch.manual_seed(0)
    model = TunedBlock(max_len=seq).eval()
    return model, (torch.randn(batch, seq, 1024),)


def tiny_causal_lm(layers: int = 3, hidden: int = 384, prompt: int = 32) -> tuple[nn.Module, torch.Tensor]:
    """What ``rewriter demo --generate`` serves: a Qwen2-like causal LM (transformers' config,
    random weights, eval mode, 8000 words, seeded) and a 1 x ``prompt`` prompt of token ids."""
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError("the generation example builds a transformers model: "
                           "pip install 'transformers>=4.45'") from e
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(num_hidden_layers=layers, hidden_size=hidden,
                                   intermediate_size=hidden * 8 // 3, num_attention_heads=6,
                                   num_key_value_heads=2, vocab_size=8000,
                                   max_position_embeddings=512, attn_implementation="eager")
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    return model, torch.randint(0, cfg.vocab_size, (1, prompt))
