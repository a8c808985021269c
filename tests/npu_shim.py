"""A test-only stand-in for ``torch_npu``: the documented semantics of the ops rewriter emits,
in plain torch, so the NPU forms of passes can be checked on a machine without an NPU.

It implements what ``../shared/reference/npu_ecosystem.md`` documents, nothing more:
* ``npu_fusion_attention`` (§1.1): ``Dropout(Softmax(Mask(scale * (pse + q @ k^T), atten_mask)),
  keep_prob) @ v``; ``atten_mask`` True = masked out; ``scale`` defaults to 1.0; layouts BNSD,
  BSND, BSH; returns the 7-tuple whose first element is the attention output.
* ``optim.NpuFusedAdamW`` (§2.1): the documented constructor and constraints over torch's AdamW.
* ``npu.is_available/synchronize/get_rng_state_all/set_rng_state_all`` and
  ``profiler.ProfilerActivity`` (CPU, NPU), mapped onto the CPU.

Never shipped in the package: the tests place it in ``sys.modules`` through a fixture.
"""
from __future__ import annotations

import types

import torch

__version__ = "2.13.0.shim"


def _to_bnsd(x: torch.Tensor, layout: str, head_num: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, head_num, h // head_num).transpose(1, 2)
    raise NotImplementedError(f"shim: layout {layout}")


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None,
                         actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    if sparse_mode != 0 or padding_mask is not None or prefix is not None:
        raise NotImplementedError("shim: only sparse_mode=0 without padding_mask/prefix")
    q = _to_bnsd(query, input_layout, head_num)
    k = _to_bnsd(key, input_layout, head_num)
    v = _to_bnsd(value, input_layout, head_num)
    if k.shape[1] != q.shape[1]:  # GQA: Nq % Nkv == 0
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-2, -1)
    if pse is not None:
        scores = scores + pse
    scores = scores * scale
    if atten_mask is not None:
        scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if keep_prob < 1.0:
        probs = torch.nn.functional.dropout(probs, 1.0 - keep_prob, training=True)
    out = probs @ v
    if input_layout == "BSND":
        out = out.transpose(1, 2)
    elif input_layout == "BSH":
        out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
    stats = torch.zeros(q.shape[:-1] + (8,), dtype=torch.float32)
    return out, stats, stats, torch.empty(0), 0, 0, 0


class _Activity:
    CPU = torch.profiler.ProfilerActivity.CPU
    NPU = torch.profiler.ProfilerActivity.CPU  # the shim's "device" is the CPU


npu = types.SimpleNamespace(
    is_available=lambda: True,
    synchronize=lambda: None,
    get_rng_state_all=lambda: [torch.get_rng_state()],
    set_rng_state_all=lambda states: torch.set_rng_state(states[0]),
)
profiler = types.SimpleNamespace(ProfilerActivity=_Activity)


def as_module() -> types.ModuleType:
    mod = types.ModuleType("torch_npu")
    mod.__version__ = __version__
    mod.npu_fusion_attention = npu_fusion_attention
    mod.npu = npu
    mod.profiler = profiler
    mod.optim = optim
    return mod


class NpuFusedAdamW(torch.optim.AdamW):
    """Constructor as documented (§2.1): (params, lr=1e-3, betas=(0.9,0.999), eps=1e-8,
    weight_decay=1e-2, amsgrad=False); fp32/fp16 params only; set_to_none refused."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=False)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dtype not in (torch.float32, torch.float16):
                    raise TypeError("Fused optimizer's parameters must be either float32 or float16")

    def zero_grad(self, set_to_none=False):
        if set_to_none:
            raise ValueError("set_to_none is not supported in fused optimizers")
        super().zero_grad(set_to_none=False)

    def clip_grad_norm_fused_(self, max_norm, norm_type=2):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


optim = types.SimpleNamespace(NpuFusedAdamW=NpuFusedAdamW)
