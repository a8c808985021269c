"""Small model factories for the offline script's tests, in the shapes SPEC allows.

``rewriter optimize tests/factories/tiny_models.py:attention_block`` loads this file by path;
``tests.factories.tiny_models:attention_block`` imports it as a module.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, DIM, HEADS = 16, 32, 4


class AttentionBlock(nn.Module):
    """Hand-written causal attention and an MLP, written so ``torch.fx.symbolic_trace`` captures
    it whole (sizes read with ``x.shape[i]``, never unpacked), so the fx front-end is used."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, max_len: int = SEQ) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.w_up = nn.Parameter(torch.randn(4 * dim, dim) / math.sqrt(dim))
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape[0], x.shape[1], x.shape[2]  # Proxies under symbolic_trace
        hd = c // self.heads
        q, k, v = self.qkv(self.norm(x)).split(DIM, dim=-1)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)     # (B, heads, T, hd)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(DIM // HEADS)
        scores = scores.masked_fill(~self.causal, float("-inf"))  # (T, T): T is fixed at max_len
        y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        h = x + self.proj(y)
        return h + torch.matmul(F.gelu(torch.matmul(h, self.w_up.t())), self.w_up)


def attention_block() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, positional example inputs)."""
    torch.manual_seed(0)
    return AttentionBlock(), (torch.randn(2, SEQ, DIM),)


def attention_block_kwargs() -> tuple[nn.Module, dict]:
    """(model, keyword example inputs)."""
    torch.manual_seed(0)
    return AttentionBlock(), {"x": torch.randn(2, SEQ, DIM)}


def attention_block_batch3() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The same model on another batch size: a plan made for batch 2 does not fit."""
    torch.manual_seed(0)
    return AttentionBlock(), (torch.randn(3, SEQ, DIM),)


def model_only() -> nn.Module:
    """Only the model: the script then needs ``--input``."""
    torch.manual_seed(0)
    return AttentionBlock()


LOSS_CALLS = [0]


def counting_loss(output: torch.Tensor) -> torch.Tensor:
    """A ``--loss`` function, ``loss_fn(output) -> scalar``, counting its calls."""
    LOSS_CALLS[0] += 1
    return output.float().pow(2).mean()


def not_a_model() -> int:
    return 3


NOT_CALLABLE = 7
