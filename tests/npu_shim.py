"""A test-only stand-in for ``torch_npu``, strict: what the kernels check, in plain torch.

It implements what ``../shared/reference/npu_ecosystem.md`` documents and what torch_npu's
sources check, nothing more, so that the NPU forms of passes can be checked on a machine
without an NPU. It emulates one chip model and one torch_npu version, given to
:func:`as_module` (the ``fake_torch_npu`` fixture: an Atlas A2 part and the newest release):

* ``npu.get_device_name()`` returns the emulated SoC name, ``npu.is_bf16_supported()`` is
  True on A2/A3 only, and ops a release does not have are absent from the module (npu_gelu
  before TorchNPU 6.0.0).
* Every op checks what its kernel checks: **every tensor on the first input's device**
  (``format_trans`` in op-plugin's FlashAttentionKernelNpuOpApi.cpp: "only npu tensor is
  supported"; run the graph on ``meta`` and a tensor made on the CPU shows up), the products
  its docs list, its documented dtypes (and dtype pairs), ranks and shape limits.
* ``npu_fusion_attention`` (§1.1): ``Dropout(Softmax(Mask(scale * (pse + q @ k^T),
  atten_mask)), keep_prob) @ v``; ``atten_mask`` bool/uint8, True = masked out, shaped BNSS,
  B1SS, 11SS or SS (sparse_mode 2: the compressed 2048x2048 triu mask); ``scale`` defaults to
  1.0; query heads 1-256, a multiple of the key heads; key and value of one shape; Dq == Dk <=
  768; ``keep_prob`` in (0, 1]; layouts BNSD, BSND, BSH; returns the 7-tuple.
* ``npu_fused_infer_attention_score`` (§1.2): BNSD, ``sparse_mode`` 0; fp16/bf16, contiguous
  inputs; ``num_heads`` the query's heads (<= 256), ``num_key_value_heads`` the key's (a divisor,
  at most 64 query heads each); a bool/int8/uint8 mask ending in (Sq, Skv) (for a one-token
  query (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S)), True = masked out;
  products A2/A3; its scale keyword is ``scale_value`` before TorchNPU 7.0.0 and ``scale`` after;
  no backward (called with grad on inputs that require it, it raises); returns (out, lse).
* ``optim.NpuFusedAdam`` / ``NpuFusedAdamW`` (§2.1): the documented constructors and
  constraints, and the update as ``torch_npu/optim/npu_fused_adamw.py`` runs it: the group's
  step counter is the first parameter's ``state['step']`` object, incremented once through
  every parameter's state and once more as the combined counter (so a 0-d tensor ``step``,
  which torch's optimizers keep, advances twice per step).
* ``npu.is_available/synchronize/get_rng_state_all/set_rng_state_all`` and
  ``profiler.ProfilerActivity`` (CPU, NPU), mapped onto the CPU.

Never shipped in the package: the tests place it in ``sys.modules`` through a fixture.
"""
from __future__ import annotations

import math
import types

import torch

# Emulated chips (SoC names as torch.npu.get_device_name() returns them, NpuVariables.cpp).
A2_CHIP = "Ascend910B2"      # Atlas A2 training
P310_CHIP = "Ascend310P3"    # Atlas 300I Pro / Duo (Atlas inference, 310P)
A3_CHIP = "Ascend910_9392"   # Atlas A3
TRAINING_CHIP = "Ascend910A"  # Atlas training (910)
# Emulated torch_npu versions: the oldest the project claims (TorchNPU 6.0.0), the newest in
# Ascend/pytorch COMPATIBILITY.en.md (26.1.0), and one below the floor (6.0.rc3: no npu_gelu).
OLDEST_VERSION = "2.4.0.post2"
NEWEST_VERSION = "2.12.0"
TOO_OLD_VERSION = "2.4.0"

_emulated = {"chip": A2_CHIP, "version": NEWEST_VERSION}
__version__ = NEWEST_VERSION

_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32


def _family() -> str:
    chip = _emulated["chip"]
    if chip in ("Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B"):
        return "training"
    if chip.startswith("Ascend910B"):
        return "A2"
    if chip.startswith("Ascend910_93"):
        return "A3"
    if chip.startswith("Ascend310P"):
        return "310P"
    return "other"


def _on_one_device(op, first, **tensors):
    """Every tensor on ``first``'s device, as op-plugin's kernels require of NPU tensors."""
    for name, t in tensors.items():
        if t is not None and t.device != first.device:
            raise RuntimeError(f"{op}: Expected all tensors to be on the same device, but {name} is on "
                               f"{t.device} and the input on {first.device} (only npu tensor is supported)")


def _products(op, families):
    if _family() not in families:
        raise RuntimeError(f"{op} is not supported on {_emulated['chip']}")


def _dtypes(op, t, allowed):
    if t.dtype not in allowed:
        raise TypeError(f"{op}: dtype {t.dtype} is not supported on {_emulated['chip']}")


def _float_dtypes(bf16_families):
    return {_F16, _F32} | ({_BF16} if _family() in bf16_families else set())


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
    op = "npu_fusion_attention"
    _products(op, ("A2", "A3"))  # Atlas A2 training (+ Ascend 950DT, A3 via SDPA's routing), §1.1
    if sparse_mode not in (0, 2) or padding_mask is not None or prefix is not None:
        raise NotImplementedError("shim: only sparse_mode 0 and 2, without padding_mask/prefix")
    _on_one_device(op, query, key=key, value=value, pse=pse, atten_mask=atten_mask)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() not in (3, 4):
            raise RuntimeError(f"{op}: The shapes of the input {name} should be 3 or 4 dimensional")
    if not 0 < keep_prob <= 1:
        raise RuntimeError(f"{op}: The keep_prob value must be in range of (0, 1], but got {keep_prob}")
    _dtypes(op, query, _float_dtypes(("A2", "A3")))
    if not (query.dtype == key.dtype == value.dtype) or (pse is not None and pse.dtype != query.dtype):
        raise TypeError(f"{op}: query, key, value (and pse) must share a dtype")
    q = _to_bnsd(query, input_layout, head_num)
    k = _to_bnsd(key, input_layout, head_num)
    v = _to_bnsd(value, input_layout, head_num)
    b, n, sq, d = q.shape
    skv = k.shape[2]
    if n != head_num or not 1 <= n <= 256:
        raise RuntimeError(f"{op}: head_num {head_num} must be the query's heads {n}, in 1..256")
    if k.shape != v.shape:
        raise RuntimeError(f"{op}: key {tuple(k.shape)} and value {tuple(v.shape)} must have one shape")
    if k.shape[-1] != d or not 1 <= d <= 768 or n % k.shape[1]:
        raise RuntimeError(f"{op}: needs Dq == Dk in 1..768 and Nq % Nkv == 0, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if atten_mask is not None:
        _dtypes(op + " atten_mask", atten_mask, (torch.bool, torch.uint8))
        want = [(2048, 2048)] if sparse_mode == 2 else [(b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)]
        if tuple(atten_mask.shape) not in want:
            raise RuntimeError(f"{op}: atten_mask {tuple(atten_mask.shape)} is none of "
                               f"{'the compressed 2048x2048' if sparse_mode == 2 else 'BNSS, B1SS, 11SS, SS'}")
    if k.shape[1] != n:  # GQA: Nq % Nkv == 0
        rep = n // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-2, -1)
    if pse is not None:
        scores = scores + pse
    scores = scores * scale
    if sparse_mode == 2:
        # leftUpCausal: atten_mask must be the compressed 2048x2048 triu(1) mask (§1.1)
        if atten_mask is None:
            raise ValueError("sparse_mode=2 expects the compressed 2048x2048 triu mask")
        if atten_mask.device.type != "meta":
            expected = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=atten_mask.device), 1)
            if not torch.equal(atten_mask.bool(), expected):
                raise ValueError("sparse_mode=2 expects the compressed 2048x2048 triu mask")
        scores = scores.masked_fill(torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    elif atten_mask is not None:
        scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if keep_prob < 1.0:
        probs = torch.nn.functional.dropout(probs, 1.0 - keep_prob, training=True)
    out = probs @ v
    if input_layout == "BSND":
        out = out.transpose(1, 2)
    elif input_layout == "BSH":
        out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
    stats = torch.zeros(q.shape[:-1] + (8,), dtype=torch.float32, device=q.device)
    return out, stats, stats, torch.empty(0, device=q.device), 0, 0, 0


def _fused_infer_attention(query, key, value, scale, atten_mask, num_heads, pre_tokens, next_tokens,
                           input_layout, num_key_value_heads, sparse_mode, inner_precise,
                           softmax_lse_flag, pse_shift, actual_seq_lengths, actual_seq_lengths_kv):
    op = "npu_fused_infer_attention_score"
    _products(op, ("A2", "A3"))  # Atlas A2 training / 800I A2, A3 (torchair's FIA page)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        # no backward (§1.2): torch warns "an autograd kernel was not registered" and the
        # gradient is silently wrong; the shim refuses instead
        raise RuntimeError(f"{op}: an autograd kernel was not registered to the Autograd key(s) "
                           "(inference only: call it under torch.no_grad())")
    if (pse_shift is not None or actual_seq_lengths is not None or actual_seq_lengths_kv is not None
            or sparse_mode != 0 or input_layout != "BNSD" or softmax_lse_flag):
        raise NotImplementedError("shim: only BNSD, sparse_mode 0, no pse_shift/actual lengths/lse")
    _on_one_device(op, query, key=key, value=value, atten_mask=atten_mask)
    for name, t in (("query", query), ("key", key), ("value", value)):
        _dtypes(f"{op} {name}", t, {_F16, _BF16})
        if not t.is_contiguous():
            raise RuntimeError(f"{op}: {name} is not contiguous (non-contiguous tensors are not supported)")
        if t.dim() != 4:
            raise RuntimeError(f"{op}: BNSD {name} must be 4-D, got {tuple(t.shape)}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"{op}: query, key, value must share a dtype")
    b, n, sq, d = query.shape
    nkv = num_key_value_heads or num_heads
    if num_heads != n or key.shape[1] != nkv or n % nkv or n // nkv > 64 or n > 256:
        raise RuntimeError(f"{op}: num_heads {num_heads} / num_key_value_heads {num_key_value_heads} do not "
                           f"match q {tuple(query.shape)}, k {tuple(key.shape)} (N <= 256, N % Nkv == 0, N / Nkv <= 64)")
    if key.shape != value.shape or key.shape[0] != b or key.shape[-1] != d:
        raise RuntimeError(f"{op}: key {tuple(key.shape)} and value {tuple(value.shape)} do not fit q {tuple(query.shape)}")
    skv = key.shape[2]
    if atten_mask is not None:
        _dtypes(op + " atten_mask", atten_mask, (torch.bool, torch.int8, torch.uint8))
        if tuple(atten_mask.shape[-2:]) != (sq, skv):
            raise RuntimeError(f"{op}: atten_mask {tuple(atten_mask.shape)} must end in (Sq, Skv) = ({sq}, {skv})")
        if sq == 1 and tuple(atten_mask.shape) not in ((b, skv), (b, 1, skv), (b, 1, 1, skv)):
            raise RuntimeError(f"{op}: a one-token query's atten_mask is (B, KV_S), (B, 1, KV_S) or "
                               f"(B, 1, 1, KV_S), got {tuple(atten_mask.shape)}")
    with torch.no_grad():
        rep = n // nkv
        k, v = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        scores = (query.float() @ k.float().transpose(-2, -1)) * scale
        if atten_mask is not None:
            scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ v.float()).to(query.dtype)
    return out, torch.empty(0, device=query.device)


def _fia_scale_value(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                     actual_seq_lengths_kv=None, num_heads=1, scale_value=1.0, pre_tokens=2147483647,
                     next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                     inner_precise=0, softmax_lse_flag=False):
    """FIA up to TorchNPU 6.0.0: the scale is ``scale_value``."""
    return _fused_infer_attention(query, key, value, scale_value, atten_mask, num_heads, pre_tokens,
                                  next_tokens, input_layout, num_key_value_heads, sparse_mode,
                                  inner_precise, softmax_lse_flag, pse_shift, actual_seq_lengths,
                                  actual_seq_lengths_kv)


def _fia_scale(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
               actual_seq_lengths_kv=None, num_heads=1, scale=1.0, pre_tokens=2147483647,
               next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
               inner_precise=0, softmax_lse_flag=False):
    """FIA from TorchNPU 7.0.0: the scale is ``scale``."""
    return _fused_infer_attention(query, key, value, scale, atten_mask, num_heads, pre_tokens,
                                  next_tokens, input_layout, num_key_value_heads, sparse_mode,
                                  inner_precise, softmax_lse_flag, pse_shift, actual_seq_lengths,
                                  actual_seq_lengths_kv)


for _fia in (_fia_scale_value, _fia_scale):
    _fia.__name__ = _fia.__qualname__ = "npu_fused_infer_attention_score"  # as graphs print it


class _Activity:
    CPU = torch.profiler.ProfilerActivity.CPU
    NPU = torch.profiler.ProfilerActivity.CPU  # the shim's "device" is the CPU


npu = types.SimpleNamespace(
    is_available=lambda: True,
    synchronize=lambda: None,
    get_rng_state_all=lambda: [torch.get_rng_state()],
    set_rng_state_all=lambda states: torch.set_rng_state(states[0]),
    get_device_name=lambda device=None: _emulated["chip"],
    is_bf16_supported=lambda: _family() in ("A2", "A3"),
)
profiler = types.SimpleNamespace(ProfilerActivity=_Activity)

# TorchNPU release each op arrived in (issue 18's audit; reference §1), and the release of
# each emulated version (COMPATIBILITY.en.md branch names).
_RELEASE_OF = {TOO_OLD_VERSION: (6, 0, -1), OLDEST_VERSION: (6, 0, 0), NEWEST_VERSION: (26, 1, 0)}
_SINCE = {"npu_fusion_attention": (5, 0, -1), "npu_rms_norm": (5, 0, 0), "npu_swiglu": (6, 0, -1),
          "npu_geglu": (6, 0, -1), "npu_gelu": (6, 0, 0)}


def as_module(chip: str = A2_CHIP, version: str = NEWEST_VERSION) -> types.ModuleType:
    """A ``torch_npu`` module emulating ``chip`` (a SoC name) and torch_npu ``version``."""
    if version not in _RELEASE_OF:
        raise ValueError(f"shim: no release known for torch_npu {version}")
    _emulated.update(chip=chip, version=version)
    mod = types.ModuleType("torch_npu")
    mod.__version__ = version
    for op in (npu_fusion_attention,) + _FUSED_OPS:
        if _RELEASE_OF[version] >= _SINCE.get(op.__name__, (0,)):
            setattr(mod, op.__name__, op)
    # FIA's scale keyword: scale_value up to TorchNPU 6.0.0, scale from 7.0.0 (§1.2)
    mod.npu_fused_infer_attention_score = _fia_scale if _RELEASE_OF[version] >= (7, 0, 0) else _fia_scale_value
    mod.npu = npu
    mod.profiler = profiler
    mod.optim = optim
    return mod


class _NpuFusedAdamBase(torch.optim.Optimizer):
    """torch_npu's NpuFusedAdam/AdamW (§2.1, ``torch_npu/optim/npu_fused_adamw.py``), without the
    buffer flattening: fp32/fp16 params only, ``set_to_none`` refused, products Atlas training,
    A2, A3, and the step counter as that file keeps it (see the module docstring)."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
        for g in self.param_groups:
            for p in g["params"]:
                if p.dtype not in (torch.float32, torch.float16):
                    raise TypeError("Fused optimizer's parameters must be either float32 or float16")
        self._combined_step = {}

    def zero_grad(self, set_to_none=False):
        if set_to_none:
            raise ValueError("set_to_none is not supported in fused optimizers")
        super().zero_grad(set_to_none=False)

    def clip_grad_norm_fused_(self, max_norm, norm_type=2):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    @torch.no_grad()
    def step(self, closure=None):
        _products(type(self).__name__, ("A2", "A3", "training"))
        loss = closure() if closure is not None else None
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if gi not in self._combined_step:  # _combine_group_param_states, on the first step
                for p in params:
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = torch.zeros_like(p)
                # combined_step = step_list[0]: the same object when it is a tensor
                self._combined_step[gi] = {"step": self.state[params[0]]["step"]}
            for p in params:  # _group_step: every parameter's counter ...
                self.state[p]["step"] += 1
            combined = self._combined_step[gi]
            combined["step"] += 1  # ... and the combined one
            beta1, beta2 = group["betas"]
            bias_correction1 = 1 - beta1 ** combined["step"]
            bias_correction2 = 1 - beta2 ** combined["step"]
            for p in params:
                state, grad = self.state[p], p.grad
                if self.decoupled:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                elif group["weight_decay"]:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                sq = state["exp_avg_sq"]
                if group["amsgrad"]:
                    torch.max(state["max_exp_avg_sq"], sq, out=state["max_exp_avg_sq"])
                    sq = state["max_exp_avg_sq"]
                denom = (sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias_correction1)
        return loss


class NpuFusedAdamW(_NpuFusedAdamBase):
    """(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)


class NpuFusedAdam(_NpuFusedAdamBase):
    """(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False); L2 decay."""

    decoupled = False


optim = types.SimpleNamespace(NpuFusedAdamW=NpuFusedAdamW, NpuFusedAdam=NpuFusedAdam)


# --- torch_npu.profiler (reference §3) ---------------------------------------------------------
# The documented constructor, schedule, trace handler and experimental config, delegating the
# collection to torch.profiler on the CPU. The handler writes the documented output layout
# (§3.2) with the documented CSV columns (§3.3), filled from the CPU profile: the shim's
# "device" is the CPU, so device durations equal host durations. Kernel "Accelerator Core" is a
# stand-in rule, not CANN's: a leaf op with an int64 data input runs on AI_CPU (as TensorEqual
# int64 does, §4.1) unless it is an indexing op (int64 indices are normal there), else AI_CORE.

import csv  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


class ProfilerLevel:
    Level_none = "Level_none"
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"


class AiCMetrics:
    AiCoreNone = "AiCoreNone"
    PipeUtilization = "PipeUtilization"
    ArithmeticUtilization = "ArithmeticUtilization"
    Memory = "Memory"
    MemoryL0 = "MemoryL0"
    ResourceConflictRatio = "ResourceConflictRatio"
    MemoryUB = "MemoryUB"
    L2Cache = "L2Cache"
    MemoryAccess = "MemoryAccess"


class ExportType:
    Text = "text"
    Db = "db"


_LEVELS = (ProfilerLevel.Level_none, ProfilerLevel.Level0, ProfilerLevel.Level1, ProfilerLevel.Level2)


class _ExperimentalConfig:
    """Documented keywords and defaults (§3.1); aic_metrics reset to AiCoreNone at Level0/none."""

    def __init__(self, profiler_level=ProfilerLevel.Level0, aic_metrics=AiCMetrics.PipeUtilization,
                 l2_cache=False, msprof_tx=False, mstx=False, data_simplification=True,
                 record_op_args=False, op_attr=False, gc_detect_threshold=None,
                 export_type=ExportType.Text, host_sys=None, mstx_domain_include=None,
                 mstx_domain_exclude=None, sys_io=False, sys_interconnection=False):
        if profiler_level not in _LEVELS:
            raise ValueError(f"shim: unknown profiler_level {profiler_level!r}")
        if profiler_level in (ProfilerLevel.Level0, ProfilerLevel.Level_none):
            aic_metrics = AiCMetrics.AiCoreNone
        self.profiler_level = profiler_level
        self.aic_metrics = aic_metrics
        self.mstx = mstx or profiler_level == ProfilerLevel.Level_none
        self.data_simplification = data_simplification
        self.record_op_args = record_op_args
        self.export_type = export_type if export_type in (ExportType.Text, ExportType.Db) else ExportType.Text
        self.l2_cache, self.msprof_tx, self.op_attr = l2_cache, msprof_tx, op_attr
        self.gc_detect_threshold, self.host_sys = gc_detect_threshold, host_sys
        self.sys_io, self.sys_interconnection = sys_io, sys_interconnection


def schedule(wait, active, warmup=0, repeat=0, skip_first=0, skip_first_wait=0):
    """torch_npu's argument order: (wait, active, warmup, ...)."""
    return torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat,
                                   skip_first=skip_first, skip_first_wait=skip_first_wait)


class _ShimProfile:
    """``torch_npu.profiler.profile``: keyword-only, as documented (§3.1)."""

    def __init__(self, *, activities=None, schedule=None, on_trace_ready=None, record_shapes=False,
                 profile_memory=False, with_stack=False, with_flops=False, with_modules=False,
                 experimental_config=None, execution_trace_observer=None,
                 custom_trace_id_callback=None, use_cuda=None):
        activities = list(activities) if activities is not None else [_Activity.CPU, _Activity.NPU]
        if any(a not in (_Activity.CPU, _Activity.NPU) for a in activities):
            raise TypeError(f"shim: activities must be torch_npu.profiler.ProfilerActivity, got {activities}")
        if experimental_config is not None and not isinstance(experimental_config, _ExperimentalConfig):
            raise TypeError("shim: experimental_config must be torch_npu.profiler._ExperimentalConfig")
        self.activities = activities
        self.experimental_config = experimental_config or _ExperimentalConfig()
        if self.experimental_config.export_type != ExportType.Text:
            raise NotImplementedError("shim: only ExportType.Text output is written")
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.scheduled = schedule is not None
        self._torch = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
            on_trace_ready=(lambda _: on_trace_ready(self)) if on_trace_ready else None,
            record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
            with_flops=with_flops, with_modules=with_modules)

    def start(self):
        self._torch.start()

    def stop(self):
        self._torch.stop()

    def step(self):
        self._torch.step()

    def __enter__(self):
        self._torch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._torch.__exit__(*exc)

    def export_chrome_trace(self, path):
        return self._torch.export_chrome_trace(path)


def tensorboard_trace_handler(dir_name=None, worker_name=None, analyse_flag=True, async_mode=False):
    """Writes ``{dir}/{worker}_{timestamp}_ascend_pt/`` (§3.2) when a profiling cycle ends."""
    def handler(prof):
        worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"
        stamp = time.strftime("%Y%m%d%H%M%S") + f"{int(time.time() * 1000) % 1000:03d}"
        root = os.path.join(dir_name or ".", f"{worker}_{stamp}_ascend_pt")
        while os.path.exists(root):  # two cycles within one millisecond
            root += "_"
        for sub in ("ASCEND_PROFILER_OUTPUT", "FRAMEWORK", "logs"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        with open(os.path.join(root, "profiler_info_0.json"), "w") as f:
            json.dump({"config": {"common_config": {"activities": [str(a) for a in prof.activities]},
                                  "experimental_config": vars(prof.experimental_config)}}, f, default=str)
        with open(os.path.join(root, "profiler_metadata.json"), "w") as f:
            json.dump({"ENV_VARIABLES": {}}, f)
        if analyse_flag:
            _write_ascend_output(prof, os.path.join(root, "ASCEND_PROFILER_OUTPUT"))
    return handler


_INDEXING = {"embedding", "index_select", "gather", "index", "index_put_", "scatter", "scatter_",
             "scatter_add_", "embedding_dense_backward", "take", "masked_select", "nonzero"}
_DTYPES = {"float": "FLOAT", "c10::Half": "FLOAT16", "c10::BFloat16": "BF16", "double": "DOUBLE",
           "long int": "INT64", "int": "INT32", "bool": "BOOL", "signed char": "INT8",
           "unsigned char": "UINT8", "short int": "INT16"}


def _shapes(shapes):
    return ";".join(",".join(str(d) for d in s) for s in shapes)


def _write_ascend_output(prof, out):
    events = [e for e in prof._torch.events() if e.name.startswith("aten::")]
    _write_operator_details(events, out)
    _write_kernel_details(events, out, prof.record_shapes, prof.scheduled)
    trace = _write_trace_view(prof._torch, out)
    if prof.profile_memory:
        _write_operator_memory(trace, out)


def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _write_operator_details(events, out):
    header = ["Name", "Input Shapes", "Call Stack", "Host Self Duration(us)", "Host Total Duration(us)",
              "Device Self Duration(us)", "Device Total Duration(us)",
              "Device Self Duration With AICore(us)", "Device Total Duration With AICore(us)"]
    rows = []
    for e in events:
        self_us, total_us = e.self_cpu_time_total, e.cpu_time_total
        rows.append([e.name, _shapes(e.input_shapes or []), ";".join(e.stack or []),
                     f"{self_us:.3f}", f"{total_us:.3f}", f"{self_us:.3f}", f"{total_us:.3f}",
                     f"{self_us:.3f}", f"{total_us:.3f}"])
    _write_csv(os.path.join(out, "operator_details.csv"), header, rows)


def _accelerator_core(op_type, dtypes):
    if op_type not in _INDEXING and "INT64" in dtypes:
        return "AI_CPU"
    return "AI_CORE"


def _write_kernel_details(events, out, record_shapes, scheduled):
    leaves = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    header = (["Step Id"] if scheduled else []) + [
        "Device_id", "Name", "Type", "Accelerator Core", "Start Time(us)", "Duration(us)",
        "Wait Time(us)", "Block Num"]
    if record_shapes:
        header += ["Input Shapes", "Input Data Types", "Input Formats", "Output Shapes",
                   "Output Data Types", "Output Formats"]
    rows, stats = [], {}
    for i, e in enumerate(leaves):
        op_type = e.name[len("aten::"):]
        dtypes = [_DTYPES.get(d, d.upper()) for d in (e.input_dtypes or []) if d and d != "Scalar"]
        core = _accelerator_core(op_type, dtypes)
        row = ([1] if scheduled else []) + [0, f"{op_type}_{i}", op_type, core, f"{e.time_range.start:.3f}",
                                            f"{e.self_cpu_time_total:.3f}", "0", 1]
        if record_shapes:
            row += [_shapes(e.input_shapes or []), ";".join(dtypes), ";".join("ND" for _ in dtypes),
                    "", "", ""]
        rows.append(row)
        stats.setdefault((op_type, core), []).append(e.self_cpu_time_total)
    _write_csv(os.path.join(out, "kernel_details.csv"), header, rows)
    total = sum(sum(v) for v in stats.values()) or 1.0
    _write_csv(os.path.join(out, "op_statistic.csv"),
               ["Device_id", "OP Type", "Core Type", "Count", "Total Time(us)", "Avg Time(us)",
                "Min Time(us)", "Max Time(us)", "Ratio(%)"],
               [[0, t, c, len(v), f"{sum(v):.3f}", f"{sum(v) / len(v):.3f}", f"{min(v):.3f}",
                 f"{max(v):.3f}", f"{100 * sum(v) / total:.2f}"] for (t, c), v in stats.items()])


def _write_trace_view(torch_prof, out):
    """The Chrome trace, with ``ts`` a string of microseconds with 3 decimals (§3.3)."""
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        torch_prof.export_chrome_trace(tmp)
        with open(tmp) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(tmp)
    for e in events:
        if "ts" in e:
            e["ts"] = f"{float(e['ts']):.3f}"
    with open(os.path.join(out, "trace_view.json"), "w") as f:
        json.dump(events, f)
    return events


def _write_operator_memory(events, out):
    """One row per allocation seen in the trace's memory events, with the allocator totals."""
    header = ["Name", "Size(KB)", "Allocation Time(us)", "Release Time(us)", "Active Release Time(us)",
              "Duration(us)", "Active Duration(us)", "Allocation Total Allocated(MB)",
              "Allocation Total Reserved(MB)", "Allocation Total Active(MB)",
              "Release Total Allocated(MB)", "Release Total Reserved(MB)", "Release Total Active(MB)",
              "Stream Ptr", "Device Type"]
    live, rows = {}, []
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: float(e["ts"])):
        args = e["args"]
        total_mb = args["Total Allocated"] / 2**20
        if args["Bytes"] > 0:
            live[args["Addr"]] = (args["Bytes"], float(e["ts"]), total_mb)
        elif args["Addr"] in live:
            size, t0, at_alloc = live.pop(args["Addr"])
            t1 = float(e["ts"])
            rows.append(_memory_row(size, t0, at_alloc, t1, total_mb))
    rows += [_memory_row(size, t0, at_alloc, None, None) for size, t0, at_alloc in live.values()]
    _write_csv(os.path.join(out, "operator_memory.csv"), header, rows)


def _memory_row(size, t0, at_alloc, t1, at_release):
    """Name is left empty: the shim does not attribute allocations to operators."""
    released = t1 is not None
    return ["", f"{size / 1024:.3f}", f"{t0:.3f}", f"{t1:.3f}" if released else "",
            f"{t1:.3f}" if released else "", f"{t1 - t0:.3f}" if released else "",
            f"{t1 - t0:.3f}" if released else "", f"{at_alloc:.6f}", "0", f"{at_alloc:.6f}",
            f"{at_release:.6f}" if released else "", "0" if released else "",
            f"{at_release:.6f}" if released else "", "", "NPU:0"]


profiler.ProfilerLevel = ProfilerLevel
profiler.AiCMetrics = AiCMetrics
profiler.ExportType = ExportType
profiler._ExperimentalConfig = _ExperimentalConfig
profiler.schedule = schedule
profiler.profile = _ShimProfile
profiler.tensorboard_trace_handler = tensorboard_trace_handler


# --- fused element-wise ops (reference §1.3-1.10): documented formulas and constraints --------

_ALL_FOUR = ("A2", "A3", "training", "310P")


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """§1.3: gamma = x's trailing dims; x 2-8-D; (x, gamma) dtype pairs per chip; 310P: tail
    axis >= 32 bytes; y in x's dtype, rstd fp32."""
    op = "npu_rms_norm"
    _products(op, _ALL_FOUR)
    _on_one_device(op, x, gamma=gamma)
    if not 2 <= x.ndim <= 8 or tuple(gamma.shape) != tuple(x.shape[x.ndim - gamma.ndim:]):
        raise RuntimeError(f"{op}: x {tuple(x.shape)} (2-8-D) and gamma {tuple(gamma.shape)} (its trailing dims)")
    pairs = {(_F16, _F16), (_F32, _F32)}
    if _family() in ("A2", "A3"):
        pairs |= {(_F16, _F32), (_BF16, _F32), (_BF16, _BF16)}
    if (x.dtype, gamma.dtype) not in pairs:
        raise TypeError(f"{op}: (x, gamma) dtypes ({x.dtype}, {gamma.dtype}) are not supported on {_emulated['chip']}")
    if _family() == "310P" and x.shape[-1] * x.element_size() < 32:
        raise RuntimeError(f"{op}: the tail axis must be at least 32 bytes on {_emulated['chip']}")
    dims = tuple(range(x.ndim - gamma.ndim, x.ndim))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_gelu(x, *, approximate="none"):
    """op-plugin torch_npu-npu_gelu.md: Atlas inference, A2, Atlas training; bf16 on A2 only."""
    _products("npu_gelu", ("A2", "training", "310P"))
    _dtypes("npu_gelu", x, {_F16, _F32} | ({_BF16} if _family() == "A2" else set()))
    return torch.nn.functional.gelu(x, approximate=approximate)


def npu_fast_gelu(x):
    """§1.8: fp16/fp32, bf16 on A2/A3."""
    _products("npu_fast_gelu", _ALL_FOUR)
    _dtypes("npu_fast_gelu", x, _float_dtypes(("A2", "A3")))
    return x / (1 + torch.exp(-1.702 * x))  # the A2/A3 formula


def npu_swiglu(x, dim=-1):
    """§1.6: Atlas A2 only; 1-8-D, even along ``dim``, contiguous; fp32/fp16/bf16."""
    _products("npu_swiglu", ("A2",))
    _dtypes("npu_swiglu", x, {_F16, _BF16, _F32})
    if not x.is_contiguous():
        raise RuntimeError("npu_swiglu: non-contiguous input is not supported")
    if not 1 <= x.ndim <= 8 or x.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: 1-8-D input with an even size along dim {dim}, got {tuple(x.shape)}")
    a, b = x.chunk(2, dim)
    return torch.nn.functional.silu(a) * b


def npu_geglu(x, dim=-1, approximate=1, activate_left=False):
    """§1.7: even along ``dim``; bf16 not on Atlas training/310P."""
    _products("npu_geglu", _ALL_FOUR)
    _dtypes("npu_geglu", x, _float_dtypes(("A2", "A3")))
    if not 1 <= x.ndim <= 8 or x.shape[dim] % 2:
        raise RuntimeError(f"npu_geglu: 1-8-D input with an even size along dim {dim}, got {tuple(x.shape)}")
    a, b = x.chunk(2, dim)
    mode = "tanh" if approximate == 1 else "none"
    if activate_left:
        gelu = torch.nn.functional.gelu(a, approximate=mode)
        return gelu * b, gelu
    gelu = torch.nn.functional.gelu(b, approximate=mode)
    return a * gelu, gelu


def _rotary_layout(x, r):
    """(B, N) of ``x`` read through the layout ``r``'s shape documents, or None."""
    a, b, c, d = x.shape
    return {(1, 1, c, d): (a, b), (a, 1, c, d): (a, b), (a, b, c, d): (a, b),   # BNSD
            (1, b, 1, d): (a, c), (a, b, 1, d): (a, c),                         # BSND
            (a, 1, 1, d): (b, c)}.get(tuple(r.shape))                          # SBND


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    """§1.5 / torch_npu-npu_rotary_mul.md: one device and dtype for x, r1, r2; A2/A3: D even and
    < 896, B and N < 1000, tables 11SD/B1SD/BNSD, 1S1D/BS1D/BSND, S11D/SB1D/SBND (4-D here);
    Atlas training/310P compile online: 4-D, D == 128, B and N <= 1000."""
    op = "npu_rotary_mul"
    if rotary_mode != "half":
        raise NotImplementedError("shim: only rotary_mode='half'")
    _products(op, _ALL_FOUR)
    _on_one_device(op, x, r1=r1, r2=r2)
    _dtypes(op, x, _float_dtypes(("A2", "A3")))
    if r1.dtype != x.dtype or r2.dtype != x.dtype:
        raise TypeError(f"{op}: r1/r2 dtypes ({r1.dtype}, {r2.dtype}) differ from input's {x.dtype}")
    if x.ndim != 4:
        raise NotImplementedError("shim: only 4-D input (the 3-D TND form is not emulated)")
    bn = _rotary_layout(x, r1)
    if bn is None or tuple(r2.shape) != tuple(r1.shape):
        raise RuntimeError(f"{op}: r1 {tuple(r1.shape)} / r2 {tuple(r2.shape)} is no documented layout for {tuple(x.shape)}")
    d = x.shape[-1]
    if _family() in ("training", "310P"):
        if d != 128 or max(bn) > 1000:
            raise RuntimeError(f"{op}: with jit_compile=True: 4-D, D == 128, B and N <= 1000; got {tuple(x.shape)}")
    elif d % 2 or d >= 896 or max(bn) >= 1000:
        raise RuntimeError(f"{op}: D even and < 896, B and N < 1000; got {tuple(x.shape)}")
    x1, x2 = x.chunk(2, -1)
    return x * r1 + torch.cat((-x2, x1), -1) * r2


def npu_confusion_transpose(x, perm, shape, transpose_first):
    """§1.10: fp16/fp32 and integers, no bf16."""
    _products("npu_confusion_transpose", _ALL_FOUR)
    _dtypes("npu_confusion_transpose", x, {_F16, _F32, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
    if transpose_first:
        return x.permute(perm).reshape(shape)
    return x.reshape(shape).permute(perm)


_FUSED_OPS = (npu_rms_norm, npu_gelu, npu_fast_gelu, npu_swiglu, npu_geglu, npu_rotary_mul,
              npu_confusion_transpose)


# --- AOE dump switch (reference §5) ------------------------------------------------------------

def set_aoe(dump_path):
    """Documented: creates ``dump_path`` if missing and turns on operator-graph dumping into it.
    The shim dumps nothing; it records the path (``npu.aoe_dump_paths``) for the tests."""
    os.makedirs(dump_path, exist_ok=True)
    npu.aoe_dump_paths.append(dump_path)


npu.set_aoe = set_aoe
npu.aoe_dump_paths = []
