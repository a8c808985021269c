"""The decode step's attention on the NPU: ``torch_npu.npu_fused_infer_attention_score`` (FIA).

In inference ``fuse_attention`` emits SDPA on the NPU, and torch_npu routes SDPA itself
(op-plugin ``ScaledDotProductAttentionKernelNpuOpApi.cpp``): a 4-D fp16/bf16/fp32 call with a
boolean mask or none goes to ``npu_fusion_attention``, the training kernel, whenever it
qualifies, a one-token query against the KV cache included; FIA, the inference kernel whose
incremental branch (IncreFlashAttention: a query of length 1) is the one written for decode,
is only its fallback. So a decode-step attention is emitted as FIA directly, called the way
that file's FIA branch calls it: layout BNSD, the key/value heads as they are (grouped-query
attention without repeating k/v: ``num_key_value_heads``), ``sparse_mode=0``, ``pre_tokens`` and
``next_tokens`` at their maximum, ``inner_precise=0`` for a query of length 1, the mask True =
masked out. Every other attention keeps SDPA.

When (that branch's conditions, FIA's docs, reference §1.2)::

    inference (FIA has no backward)      fp16 or bf16 (no fp32)       query length 1
    q, k, v 4-D (B, N, S, D)             D a multiple of 16, <= 512   B <= 65536
    query heads <= 256, a multiple of the key heads, at most 64 per key head
    key and value of one shape           no dropout                   not causal
    a boolean mask the same for every head (given as (B, 1, 1, KV_S)) or none; q, k, v not
    requiring grad
    the scale a number known when the graph is rewritten (FIA takes a host float)

Products: Atlas A2 training / 800I A2 and Atlas A3 (torchair's FIA page, 7.1.0; torch_npu's
SDPA sends it nothing below Ascend910B1). Inputs must be contiguous ("不支持非连续的Tensor"):
they are made so (a no-op for a one-token query and a concatenated cache). The scale keyword
is ``scale_value`` up to TorchNPU 6.0.0 and ``scale`` from 7.0.0 (each release's API reference):
:func:`fia_scale_keyword`. Checked against the strict shim (``tests/npu_shim.py``), which runs
the documented semantics in plain torch; not measured on an NPU here::

    why_not = fia_problem(spec, caps)          # None: FIA serves this site
    out = emit_fia(graph, torch_npu.npu_fused_infer_attention_score, spec, keyword)
"""
from __future__ import annotations

import operator
from typing import Any, Callable

from torch.fx import Graph, Node

from rewriter.capture.ir import tensor_info
from rewriter.devices.npu_capabilities import NpuCapabilities, torch_npu_release

TOKEN_MAX = 2147483647
FIA_MAX_HEADS, FIA_MAX_HEAD_DIM, FIA_MAX_BATCH, FIA_MAX_GROUP = 256, 512, 65536, 64


def fia_scale_keyword(version: str) -> str | None:
    """The keyword FIA takes its scale by in torch_npu ``version`` (None: release unknown)."""
    release = torch_npu_release(version)
    if release is None:
        return None
    return "scale" if int(release.split(".")[0]) >= 7 else "scale_value"


def fia_problem(spec: Any, caps: NpuCapabilities | None, keep: Any = None) -> str | None:
    """None when FIA serves the attention ``spec`` (an AttentionSpec) in inference here, else
    why SDPA is kept. ``keep``: the boolean keep mask the emission would use (None: none)."""
    if caps is None:
        return "torch_npu does not import here"
    why = caps.cannot_run("decode_attention", spec.dtype)
    if why:
        return why
    if fia_scale_keyword(caps.version) is None:
        return f"no TorchNPU release known for torch_npu {caps.version}: FIA's scale keyword is unknown"
    q, k, v = spec.q_shape, _grouped(spec, "k"), _grouped(spec, "v")
    if not k or not v:
        return "the key/value heads FIA would get are not recorded"
    if not (len(q) == len(k) == len(v) == 4):
        return "FIA is emitted for 4-D (B, N, S, D) q, k, v"
    b, n, sq, d = q
    if sq != 1:
        return f"a query of {sq} tokens is not a decode step (FIA's incremental branch takes 1)"
    if spec.is_causal or spec.dropout_p:
        return "a causal or dropout attention keeps SDPA"
    if spec.additive_mask is not None and keep is None:
        return "an additive mask that is not a boolean one keeps SDPA"
    if any(info is not None and info.requires_grad
           for info in (tensor_info(x) for x in (spec.q, _grouped_node(spec, "k"), _grouped_node(spec, "v")))):
        return "q, k or v requires grad here; FIA has no backward"
    mask = spec.mask_shape
    if keep is not None and mask is not None and len(mask) >= 3 and mask[-3] != 1:
        return f"a mask that differs per head {list(mask)} is not one of FIA's one-token shapes"
    if not isinstance(spec.scale, (int, float)):
        return "the scale is computed at run time; FIA takes a host float"
    if d % 16 or d > FIA_MAX_HEAD_DIM or k[-1] != d:
        return f"FIA needs Dq == Dk, a multiple of 16, <= {FIA_MAX_HEAD_DIM}; got {d} and {k[-1]}"
    if b > FIA_MAX_BATCH or k[0] != b:
        return f"FIA needs one batch <= {FIA_MAX_BATCH} for q and k, got {b} and {k[0]}"
    if k != v:
        return f"FIA needs key and value of one shape, got {list(k)} and {list(v)}"
    nkv = k[1]
    if not (1 <= n <= FIA_MAX_HEADS and 1 <= nkv and n % nkv == 0 and n // nkv <= FIA_MAX_GROUP):
        return (f"FIA needs <= {FIA_MAX_HEADS} query heads, a multiple of the key heads and at most "
                f"{FIA_MAX_GROUP} per key head; got {n} and {nkv}")
    return None


def fia_mask_shape(spec: Any) -> tuple[int, int, int, int]:
    """The mask shape FIA's docs give for a one-token query, (B, 1, 1, KV_S): a mask is
    expanded to it (one that differs per head was declined by :func:`fia_problem`)."""
    return (spec.q_shape[0], 1, 1, _grouped(spec, "k")[2])


def emit_fia(graph: Graph, fia: Callable[..., Any], spec: Any, scale_keyword: str,
             masked: Node | None) -> Node:
    """``fia(q, k, v, ...)[0]`` for ``spec``; ``masked``: the boolean mask, True = masked out,
    shaped (B, 1, 1, KV_S) (or None)."""
    q, k, v = (graph.call_method("contiguous", (x,)) for x in (spec.q, _grouped_node(spec, "k"),
                                                                _grouped_node(spec, "v")))
    kwargs: dict[str, Any] = {
        "atten_mask": masked, "num_heads": spec.q_shape[1], scale_keyword: float(spec.scale),
        "pre_tokens": TOKEN_MAX, "next_tokens": TOKEN_MAX, "input_layout": "BNSD",
        "num_key_value_heads": _grouped(spec, "k")[1], "sparse_mode": 0, "inner_precise": 0}
    out = graph.call_function(fia, (q, k, v), kwargs)
    return graph.call_function(operator.getitem, (out, 0))


def _grouped(spec: Any, which: str) -> tuple[int, ...]:
    """k's or v's shape as FIA gets it: before repeat_kv where the graph repeated them (empty
    when that tensor's shape is not recorded, e.g. a node made while rewriting: then declined)."""
    node = getattr(spec, f"{which}_grouped")
    if node is None:
        return getattr(spec, f"{which}_shape")
    info = tensor_info(node)
    return tuple(info.shape) if info is not None else ()


def _grouped_node(spec: Any, which: str) -> Node:
    node = getattr(spec, f"{which}_grouped")
    return node if node is not None else getattr(spec, which)

