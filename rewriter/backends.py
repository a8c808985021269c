"""Device backends: one object per device type, and the fused replacements each offers.

Passes never name a device's kernels themselves; they ask the backend for the replacement, so
one pass has an NPU form (``torch_npu.npu_*``) and a CPU/CUDA form (stock torch)::

    backend = rewriter.backends.get_backend("cpu")
    reason = backend.cannot_fuse_attention(spec)      # None, or why this device declines
    node = backend.emit_attention(graph, spec)        # inserts the fused call

``torch_npu`` is imported only here, lazily and guarded: without the CANN toolkit its import
fails (reference npu_ecosystem.md §7), and a CUDA build of torch refuses it on import.
"""
from __future__ import annotations

import importlib
import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

log = logging.getLogger(__name__)


@dataclass
class AttentionSpec:
    """A matched attention: ``softmax(q @ k^T * scale + mask) [dropout] @ v``.

    ``keep_mask`` is boolean with True = attend (PyTorch SDPA's convention); ``additive_mask`` is
    added to the scores. At most one of the two is set. ``bool_of_additive`` is a boolean keep
    mask equivalent to ``additive_mask`` when the additive mask was built as
    ``where(keep, 0, very_negative)`` (what transformers builds), else None.
    """

    q: Node
    k: Node  # (..., S, D): already un-transposed
    v: Node
    scale: float | Node | None  # None at find time when computed on the host at run time
    dropout_p: float
    keep_mask: Node | None = None
    additive_mask: Node | None = None
    bool_of_additive: Node | None = None
    q_shape: tuple[int, ...] = ()
    k_shape: tuple[int, ...] = ()
    v_shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    # The mask is exactly "key j visible from query i iff j <= i" (L == S): no mask tensor needed.
    is_causal: bool = False
    # Grouped-query attention: k and v before repeat_kv (fewer heads), when the graph repeated them.
    k_grouped: Node | None = None
    v_grouped: Node | None = None


class Backend:
    """Base of the device backends. Subclasses fill in the device-specific parts."""

    name: str = ""
    device_type: str = ""
    amp_dtypes: tuple[torch.dtype, ...] = ()
    matmul_alignment: int = 1  # elements; a MatMul dimension that is a multiple runs best

    def is_available(self) -> bool:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work, so a host clock measures it."""

    def profiler_activities(self) -> list[Any]:
        return [torch.profiler.ProfilerActivity.CPU]

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def rng_states(self) -> list[tuple[Any, Any]]:
        """(module, state) pairs of this device's generators, for snapshot and restore."""
        return []

    # Kinds of fused replacement this backend emits (passes ask before matching).
    fused_ops: frozenset[str] = frozenset()

    def offers(self, kind: str) -> bool:
        return kind in self.fused_ops

    # --- simple fused ops: each returns the node whose value replaces the matched output ------
    def emit_rms_norm(self, graph: Graph, x: Node, weight: Node | None, eps: float, dim: int) -> Node:
        return graph.call_function(F.rms_norm, (x, (dim,), weight, eps))

    def emit_layer_norm(self, graph: Graph, x: Node, weight: Node | None, bias: Node | None,
                        eps: float, dim: int) -> Node:
        return graph.call_function(F.layer_norm, (x, (dim,), weight, bias, eps))

    def emit_gelu_tanh(self, graph: Graph, x: Node) -> Node:
        return graph.call_function(F.gelu, (x,), {"approximate": "tanh"})

    def emit_quick_gelu(self, graph: Graph, x: Node) -> Node:
        raise NotImplementedError(f"{self.name} has no fused x*sigmoid(1.702x)")

    def emit_swiglu(self, graph: Graph, packed: Node, dim: int) -> Node:
        raise NotImplementedError(f"{self.name} has no fused SwiGLU")

    def emit_geglu(self, graph: Graph, packed: Node, dim: int, approximate: str) -> Node:
        raise NotImplementedError(f"{self.name} has no fused GeGLU")

    def emit_rotary(self, graph: Graph, x: Node, cos: Node, sin: Node) -> Node:
        raise NotImplementedError(f"{self.name} has no fused rotary embedding")

    def emit_confusion_transpose(self, graph: Graph, x: Node, perm: list[int], shape: list[int],
                                 transpose_first: bool) -> Node:
        raise NotImplementedError(f"{self.name} has no fused transpose+reshape")

    # --- attention -----------------------------------------------------------------------------
    def cannot_fuse_attention(self, spec: AttentionSpec, training: bool) -> str | None:
        return "this backend has no fused attention"

    def emit_attention(self, graph: Graph, spec: AttentionSpec, training: bool) -> Node:
        raise NotImplementedError(f"{self.name} backend has no fused attention")

    def __repr__(self) -> str:
        return f"<{self.name} backend>"


def _emit_sdpa(graph: Graph, spec: AttentionSpec, mask: Node | None) -> Node:
    kwargs: dict[str, Any] = {"attn_mask": None if spec.is_causal else mask,
                              "dropout_p": spec.dropout_p, "scale": spec.scale}
    if spec.is_causal:
        kwargs["is_causal"] = True
    return graph.call_function(F.scaled_dot_product_attention, (spec.q, spec.k, spec.v), kwargs)


class _SdpaAttention:
    """F.scaled_dot_product_attention: CPU and CUDA pick flash / memory-efficient / math kernels."""

    def cannot_fuse_attention(self, spec: AttentionSpec, training: bool) -> str | None:
        if not (len(spec.q_shape) == len(spec.k_shape) == len(spec.v_shape) >= 3):
            return "q, k, v must have the same rank (at least 3)"
        if spec.q_shape[:-2] != spec.k_shape[:-2] or spec.k_shape[:-2] != spec.v_shape[:-2]:
            return f"batch dimensions of q {spec.q_shape}, k {spec.k_shape}, v {spec.v_shape} differ"
        return None

    def emit_attention(self, graph: Graph, spec: AttentionSpec, training: bool) -> Node:
        return _emit_sdpa(graph, spec, spec.keep_mask if spec.keep_mask is not None else spec.additive_mask)


_STOCK_TORCH_OPS = frozenset({"attention", "rms_norm", "layer_norm", "gelu_tanh"})


class CpuBackend(_SdpaAttention, Backend):
    fused_ops = _STOCK_TORCH_OPS
    name = "cpu"
    device_type = "cpu"
    amp_dtypes = (torch.bfloat16,)

    def is_available(self) -> bool:
        return True


class CudaBackend(_SdpaAttention, Backend):
    fused_ops = _STOCK_TORCH_OPS
    name = "cuda"
    device_type = "cuda"
    amp_dtypes = (torch.float16, torch.bfloat16)
    matmul_alignment = 8

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def profiler_activities(self) -> list[Any]:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "cuda": str(torch.version.cuda)}

    def rng_states(self) -> list[tuple[Any, Any]]:
        return [(torch.cuda, torch.cuda.get_rng_state_all())] if torch.cuda.is_available() else []


def import_torch_npu() -> Any | None:
    """``torch_npu`` if it imports here, else None (no CANN, or a CUDA build of torch)."""
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError) as e:
        log.debug("torch_npu unavailable: %s", e)
        return None


# npu_fusion_attention's D limit (reference npu_ecosystem.md §1.1: Dq=Dk, Dk>=Dv, 1..768).
_NPU_FA_MAX_HEAD_DIM = 768


class NpuBackend(Backend):
    """Ascend NPU through torch_npu. Written to the documented API (reference npu_ecosystem.md);
    tested here against a shim that implements those ops' documented semantics in plain torch."""

    name = "npu"
    device_type = "npu"
    fused_ops = frozenset({"attention", "rms_norm", "layer_norm", "gelu_tanh", "quick_gelu",
                           "swiglu", "geglu", "rotary", "confusion_transpose"})
    amp_dtypes = (torch.float16, torch.bfloat16)
    matmul_alignment = 16  # Cube unit fractal; 128 preferred for large dims (tuning guide)

    def _torch_npu(self) -> Any:
        mod = import_torch_npu()
        if mod is None:
            raise RuntimeError("the npu backend needs torch_npu, which does not import here")
        return mod

    def is_available(self) -> bool:
        mod = import_torch_npu()
        return bool(mod is not None and mod.npu.is_available())

    def synchronize(self) -> None:
        self._torch_npu().npu.synchronize()

    def profiler_activities(self) -> list[Any]:
        mod = self._torch_npu()
        return [mod.profiler.ProfilerActivity.CPU, mod.profiler.ProfilerActivity.NPU]

    def versions(self) -> dict[str, str]:
        mod = import_torch_npu()
        return {"torch": torch.__version__, "torch_npu": getattr(mod, "__version__", "absent")}

    def rng_states(self) -> list[tuple[Any, Any]]:
        mod = import_torch_npu()
        return [(mod.npu, mod.npu.get_rng_state_all())] if mod is not None else []

    def _npu_call(self, graph: Graph, op: str, args: tuple, kwargs: dict | None = None,
                  first_output: bool = False) -> Node:
        # torch_npu.<op> is torch.ops.npu.<op>; tensors go positionally (schema names differ
        # from the Chinese docs' names, reference §0.1).
        node = graph.call_function(getattr(self._torch_npu(), op), args, kwargs or {})
        return graph.call_function(operator.getitem, (node, 0)) if first_output else node

    def emit_rms_norm(self, graph: Graph, x: Node, weight: Node | None, eps: float, dim: int) -> Node:
        if weight is None:  # npu_rms_norm needs gamma (§1.3)
            weight = graph.call_function(torch.ones, ((dim,),), {"dtype": torch.float32})
        return self._npu_call(graph, "npu_rms_norm", (x, weight, eps), first_output=True)

    def emit_gelu_tanh(self, graph: Graph, x: Node) -> Node:
        return self._npu_call(graph, "npu_gelu", (x,), {"approximate": "tanh"})

    def emit_quick_gelu(self, graph: Graph, x: Node) -> Node:
        # x / (1 + exp(-1.702 x)) on A2/A3 (§1.8); an approximation of GELU on every SoC.
        return self._npu_call(graph, "npu_fast_gelu", (x,))

    def emit_swiglu(self, graph: Graph, packed: Node, dim: int) -> Node:
        # silu(first half) * second half; needs a contiguous input (§1.6).
        packed = graph.call_method("contiguous", (packed,))
        return self._npu_call(graph, "npu_swiglu", (packed, dim))

    def emit_geglu(self, graph: Graph, packed: Node, dim: int, approximate: str) -> Node:
        # activate_left=False: GELU on the second half, the one reading all docs agree on (§1.7).
        return self._npu_call(graph, "npu_geglu", (packed, dim, 0 if approximate == "none" else 1, False),
                              first_output=True)

    def emit_rotary(self, graph: Graph, x: Node, cos: Node, sin: Node) -> Node:
        return self._npu_call(graph, "npu_rotary_mul", (x, cos, sin))

    def emit_confusion_transpose(self, graph: Graph, x: Node, perm: list[int], shape: list[int],
                                 transpose_first: bool) -> Node:
        return self._npu_call(graph, "npu_confusion_transpose", (x, perm, shape, transpose_first))

    # Training uses npu_fusion_attention (FlashAttentionScore). Inference keeps SDPA with a
    # boolean mask: torch_npu already routes that to its fused kernels (§1.1), and
    # npu_fusion_attention is documented for training only.
    def cannot_fuse_attention(self, spec: AttentionSpec, training: bool) -> str | None:
        if len(spec.q_shape) != 4 or len(spec.k_shape) != 4 or len(spec.v_shape) != 4:
            return "npu_fusion_attention needs 4-D (B, N, S, D) q, k, v"
        if spec.additive_mask is not None and spec.bool_of_additive is None and not spec.is_causal:
            return ("npu fused attention takes boolean masks only; this additive mask is not "
                    "where(keep, 0, -big)")
        if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"npu fused attention does not take {spec.dtype}"
        if not training:
            return _SdpaAttention.cannot_fuse_attention(self, spec, training)  # type: ignore[arg-type]
        d = spec.q_shape[-1]
        if d != spec.k_shape[-1] or spec.v_shape[-1] > d or d > _NPU_FA_MAX_HEAD_DIM:
            return f"npu_fusion_attention needs Dq == Dk >= Dv and D <= {_NPU_FA_MAX_HEAD_DIM}"
        if spec.q_shape[1] % spec.k_shape[1]:
            return "query heads must be a multiple of key/value heads"
        return None

    def emit_attention(self, graph: Graph, spec: AttentionSpec, training: bool) -> Node:
        keep = spec.keep_mask if spec.keep_mask is not None else spec.bool_of_additive
        if not training:
            return _emit_sdpa(graph, spec, keep)
        kwargs: dict[str, Any] = {"scale": spec.scale, "keep_prob": 1.0 - spec.dropout_p}
        if spec.is_causal:
            # Causal: the compressed 2048x2048 upper-triangular mask with sparse_mode=2 (§1.1).
            kwargs["atten_mask"] = graph.call_function(
                torch.triu, (graph.call_function(torch.ones, ((2048, 2048),), {"dtype": torch.bool}), 1))
            kwargs["sparse_mode"] = 2
        elif keep is not None:
            # npu_fusion_attention masks the other way round: True = masked out (§1.1).
            kwargs["atten_mask"] = graph.call_function(torch.logical_not, (keep,))
        # Grouped-query attention runs natively (Nq % Nkv == 0): no repeated k/v needed.
        k = spec.k_grouped if spec.k_grouped is not None else spec.k
        v = spec.v_grouped if spec.v_grouped is not None else spec.v
        fa = graph.call_function(self._torch_npu().npu_fusion_attention,
                                 (spec.q, k, v, spec.q_shape[1], "BNSD"), kwargs)
        return graph.call_function(operator.getitem, (fa, 0))


_BACKENDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "npu": NpuBackend}


def get_backend(device: str | torch.device | Backend | None) -> Backend:
    """The backend for ``device`` ("cpu", "cuda", "npu", a torch.device, or a Backend)."""
    if isinstance(device, Backend):
        return device
    if device is None:
        for name in ("npu", "cuda"):
            backend = _BACKENDS[name]()
            if backend.is_available():
                return backend
        return CpuBackend()
    kind = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    if kind not in _BACKENDS:
        raise ValueError(f"unknown device {device!r}; rewriter has backends for {sorted(_BACKENDS)}")
    return _BACKENDS[kind]()
