"""Small models for the tests, each carrying the pattern a pass looks for."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ReluMLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 32), nn.Linear(32, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class TwoLayers(nn.Module):
    """ReluMLP's ops with any hidden width: one op sequence, other parameter shapes."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, hidden), nn.Linear(hidden, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class BnNet(nn.Module):
    """Conv + BatchNorm + relu + dropout: running stats and RNG for the state tests."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.head(self.drop(h.mean((2, 3))))


class TransposedLinear(nn.Module):
    """``x @ w^T + b`` written three ways (the tuning guide's MatMul case)."""

    def __init__(self, form: str, d_in: int = 32, d_out: int = 16, bias: bool = True) -> None:
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.b = nn.Parameter(torch.randn(d_out)) if bias else None

    def forward(self, x):
        if self.form == "matmul_t":
            y = torch.matmul(x, self.w.t())
        elif self.form == "at_T":
            y = x @ self.w.T
        elif self.form == "transpose":
            y = x @ self.w.transpose(0, 1)
        elif self.form == "addmm":
            return torch.addmm(self.b, x, self.w.t())
        else:
            raise ValueError(self.form)
        return y + self.b if self.b is not None else y


class HandAttention(nn.Module):
    """Attention written out by hand, in the spelling ``variant`` names."""

    def __init__(self, variant: str = "mul", d: int = 32, heads: int = 4, dropout: float = 0.0,
                 return_weights: bool = False) -> None:
        super().__init__()
        self.variant, self.heads, self.return_weights = variant, heads, return_weights
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        hd = c // self.heads
        s = torch.matmul(q, k.transpose(-1, -2))
        if self.variant == "mul":
            s = s * (1.0 / math.sqrt(hd))
        elif self.variant == "div":
            s = s / math.sqrt(hd)
        elif self.variant == "noscale":
            pass
        elif self.variant == "additive":
            s = s / math.sqrt(hd) + mask
        elif self.variant == "masked_fill":
            s = (s * hd ** -0.5).masked_fill(~mask, float("-inf"))
        elif self.variant == "where":
            s = torch.where(mask, s * hd ** -0.5, torch.finfo(torch.float32).min)
        elif self.variant == "two_masks":
            s = torch.where(mask[0], s, -1e9) + mask[1]
        elif self.variant == "mask_then_scale":
            s = (s + mask) * 0.5
        elif self.variant == "small_fill":
            s = s.masked_fill(~mask, -1.0)
        p = F.softmax(s, dim=-1 if self.variant != "dim2" else 2)
        p = self.drop(p)
        out = p @ v
        return (out, p) if self.return_weights else out


class Blocks(nn.Module):
    """``n`` identical Linear + ReLU blocks: ``n`` sites of one signature."""

    def __init__(self, n: int = 4, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x
