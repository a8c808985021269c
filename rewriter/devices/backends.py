"""Device backends: one object per device type, and the fused replacements each offers.

Passes never name a device's kernels themselves; they ask the backend for the replacement, so
one pass has an NPU form (``torch_npu.npu_*``) and a CPU/CUDA form (stock torch)::

    backend = rewriter.devices.backends.get_backend("cpu")
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

from rewriter.capture.ir import tensor_info
from rewriter.devices.cpu_identity import cpu_model
from rewriter.devices.npu_decode_attention import emit_fia, fia_mask_shape, fia_problem, fia_scale_keyword
from rewriter.devices.npu_capabilities import (
    FA_MAX_HEAD_DIM,
    FA_MAX_HEADS,
    FAMILY_NAMES,
    INFERENCE,
    JIT_COMPILE_FAMILIES,
    OPS,
    RMS_NORM_PAIRS,
    NpuCapabilities,
)

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
    # Shape of the mask as the model wrote it (broadcast to the scores), when there is one.
    mask_shape: tuple[int, ...] | None = None


class Backend:
    """Base of the device backends. Subclasses fill in the device-specific parts."""

    name: str = ""
    device_type: str = ""
    amp_dtypes: tuple[torch.dtype, ...] = ()
    matmul_alignment: int = 1  # elements; a MatMul dimension that is a multiple runs best
    cold_first_run: bool = False  # a first run that loads every kernel: the step is timed again

    def is_available(self) -> bool:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work, so a host clock measures it."""

    def profiler_activities(self) -> list[Any]:
        return [torch.profiler.ProfilerActivity.CPU]

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def machine(self) -> dict[str, str]:
        """What a timing depends on besides the software: the CPU model and torch's thread count
        (CPU kernels, and the host code that feeds a device), and the accelerator's name. A
        decision measured on an AMX Xeon with 16 threads says nothing about an AVX2 EPYC with
        2, and a home directory (the knowledge base's default place) may be shared by both."""
        return {"cpu_model": cpu_model(), "cpu_threads": str(torch.get_num_threads())}

    def knowledge_key(self) -> dict[str, str]:
        """The device part of a knowledge-base key: software versions and the machine."""
        return {**self.versions(), **self.machine()}

    def rng_states(self) -> list[tuple[Any, Any]]:
        """(module, state) pairs of this device's generators, for snapshot and restore."""
        return []

    # Kinds of fused replacement this backend emits (passes ask before matching).
    fused_ops: frozenset[str] = frozenset()

    def offers(self, kind: str) -> bool:
        return self.cannot_offer(kind) is None

    def cannot_offer(self, kind: str, *, training: bool = False) -> str | None:
        """None when this backend can emit the fused ``kind`` here, else why not (a pass that
        cannot run reports it as "not applicable")."""
        return None if kind in self.fused_ops else f"{self.name} has no fused {kind}"

    def cannot_take(self, kind: str, dtype: torch.dtype) -> str | None:
        """None when the fused ``kind`` takes tensors of ``dtype`` here, else why not."""
        return None

    def cannot_rms_norm(self, x: Any, gamma_dtype: torch.dtype | None) -> str | None:
        """None when an RMSNorm over ``x`` (a TensorInfo) with a weight of ``gamma_dtype``
        (None: no weight) can be fused here, else why not."""
        return None

    def cannot_gated(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """None when the gated activation ``kind`` ("swiglu", "geglu") takes a packed input of
        ``shape`` (halves on the last dim) and ``dtype`` here, else why not."""
        return None

    def cannot_rotary(self, x: Any, cos: Any, sin: Any) -> str | None:
        """None when a fused rotary embedding takes ``x``, ``cos``, ``sin`` (TensorInfos)."""
        return None

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

    @property
    def amp_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        """bfloat16 only where the CPU has native bf16 GEMMs (AVX512-BF16 or AMX, as oneDNN
        reports them). Elsewhere bf16 GEMMs are emulated: on an AVX2-only AMD EPYC a
        [1024, 8000] x [8000, 256] bf16 GEMM took 4.9 s, a whole GPT-2 step 31x longer than in
        fp32, so precision lowering is declined there with this reason instead of measured."""
        return (torch.bfloat16,) if cpu_has_native_bf16() else ()

    def is_available(self) -> bool:
        return True


def cpu_has_native_bf16() -> bool:
    """oneDNN's own check for AVX512-BF16/AMX (False where torch has no mkldnn)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class CudaBackend(_SdpaAttention, Backend):
    fused_ops = _STOCK_TORCH_OPS
    name = "cuda"
    device_type = "cuda"
    amp_dtypes = (torch.float16, torch.bfloat16)
    matmul_alignment = 8
    cold_first_run = True

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def profiler_activities(self) -> list[Any]:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "cuda": str(torch.version.cuda)}

    def machine(self) -> dict[str, str]:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "absent"
        return {**super().machine(), "device_name": name}

    def rng_states(self) -> list[tuple[Any, Any]]:
        return [(torch.cuda, torch.cuda.get_rng_state_all())] if torch.cuda.is_available() else []


def import_torch_npu() -> Any | None:
    """``torch_npu`` if it imports here, else None (no CANN, or a CUDA build of torch)."""
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError) as e:
        log.debug("torch_npu unavailable: %s", e)
        return None


class NpuBackend(Backend):
    """Ascend NPU through torch_npu. Written to the documented API (reference npu_ecosystem.md);
    tested here against a strict shim (``tests/npu_shim.py``) that checks what the kernels check.

    Capability gates (``rewriter.devices.npu_capabilities``): the chip model from
    ``torch.npu.get_device_name()``, the torch_npu version (at least
    ``npu_capabilities.MIN_TORCH_NPU``), ``torch.npu.is_bf16_supported()`` and each op's
    documented products, dtypes and shape limits. A pass that cannot run here gets the reason.
    """

    name = "npu"
    device_type = "npu"
    cold_first_run = True
    fused_ops = frozenset({"attention", "rms_norm", "layer_norm", "gelu_tanh", "quick_gelu",
                           "swiglu", "geglu", "rotary", "confusion_transpose"})
    matmul_alignment = 16  # Cube unit fractal; 128 preferred for large dims (tuning guide)

    def _torch_npu(self) -> Any:
        mod = import_torch_npu()
        if mod is None:
            raise RuntimeError("the npu backend needs torch_npu, which does not import here")
        return mod

    def capabilities(self) -> NpuCapabilities | None:
        """The chip and torch_npu release here (read once), or None without torch_npu."""
        if getattr(self, "_capabilities", None) is None:
            mod = import_torch_npu()
            if mod is None:
                return None
            self._capabilities = NpuCapabilities(
                chip=str(mod.npu.get_device_name()), version=str(getattr(mod, "__version__", "")),
                bf16=bool(mod.npu.is_bf16_supported()))
        return self._capabilities

    @property
    def amp_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        """float16, and bfloat16 only where ``torch.npu.is_bf16_supported()`` (§2.4)."""
        caps = self.capabilities()
        return caps.amp_dtypes if caps is not None else (torch.float16,)

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

    def machine(self) -> dict[str, str]:
        chip = "absent"
        if import_torch_npu() is not None and hasattr(torch, "npu"):
            try:
                chip = str(torch.npu.get_device_name())  # e.g. "Ascend910B3"
            except (AttributeError, RuntimeError):  # torch_npu versions differ here
                pass
        return {**super().machine(), "device_name": chip}

    def rng_states(self) -> list[tuple[Any, Any]]:
        mod = import_torch_npu()
        return [(mod.npu, mod.npu.get_rng_state_all())] if mod is not None else []

    # --- capability gates ----------------------------------------------------------------------
    def cannot_offer(self, kind: str, *, training: bool = False) -> str | None:
        if kind not in self.fused_ops:
            return f"npu has no fused {kind}"
        if kind == "attention" and not training:
            return None  # inference keeps SDPA, which torch_npu routes itself (§1.1)
        caps = self.capabilities()
        if caps is None:
            return "torch_npu does not import here"
        return caps.cannot_run(kind)

    def cannot_take(self, kind: str, dtype: torch.dtype) -> str | None:
        caps = self.capabilities()
        if caps is None or kind not in OPS:
            return None
        return caps.cannot_take(kind, dtype)

    def cannot_rms_norm(self, x: Any, gamma_dtype: torch.dtype | None) -> str | None:
        """npu_rms_norm (§1.3): x 2-8-D; (x, gamma) a documented dtype pair for the chip; the
        output takes x's dtype, so a gamma of another dtype (where PyTorch would promote) is
        declined; on 310P the tail axis must be at least 32 bytes."""
        caps = self.capabilities()
        if caps is None:
            return "torch_npu does not import here"
        if not 2 <= x.ndim <= 8:
            return f"npu_rms_norm takes 2-8-D input, not {x.ndim}-D (§1.3)"
        gamma = gamma_dtype if gamma_dtype is not None else x.dtype  # the stand-in takes x's dtype
        why = caps.cannot_take("rms_norm", x.dtype)
        if why:
            return why
        if (x.dtype, gamma) not in RMS_NORM_PAIRS.get(caps.family, set()):
            return (f"npu_rms_norm's (x, gamma) dtypes ({x.dtype}, {gamma}) are not a documented pair on "
                    f"{FAMILY_NAMES[caps.family]} (§1.3)")
        if gamma != x.dtype:
            return (f"npu_rms_norm returns x's dtype {x.dtype} where PyTorch promotes {x.dtype} * {gamma} "
                    f"to {torch.promote_types(x.dtype, gamma)} (§1.3)")
        tail = x.shape[-1] * x.dtype.itemsize
        if caps.family == INFERENCE and tail < 32:
            return f"npu_rms_norm on 310P needs a tail axis of >= 32 bytes, not {tail} (§1.3)"
        return None

    def cannot_gated(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """npu_swiglu / npu_geglu (§1.6, §1.7): 1-8-D, an even size along the split dim, and a
        dtype the chip lists (swiglu: non-contiguous input is refused, so it is made contiguous)."""
        op = OPS[kind].op
        if not 1 <= len(shape) <= 8:
            return f"{op} takes 1-8-D input, not {len(shape)}-D"
        if shape[-1] % 2:
            return f"{op} splits the last dim in halves; {shape[-1]} is odd"
        return self.cannot_take(kind, dtype)

    def cannot_rotary(self, x: Any, cos: Any, sin: Any) -> str | None:
        """npu_rotary_mul, 'half' mode (§1.5 and op-plugin torch_npu-npu_rotary_mul.md).

        A2/A3 (``jit_compile=False``): x BNSD, BSND or SBND with D even and < 896, B and N < 1000;
        cos/sin laid out 11SD/B1SD/BNSD, 1S1D/BS1D/BSND or S11D/SB1D/SBND. Atlas training and
        310P compile online (``jit_compile=True``): 4-D, B and N <= 1000, D == 128. cos and sin
        take x's dtype (mixed dtypes are not documented). The 3-D (TND) form is not matched: a
        model's (B, S, D) tensor with a (1, S, D) table would read as an undocumented 1ND table.
        """
        caps = self.capabilities()
        if caps is None:
            return "torch_npu does not import here"
        if x.ndim != 4:
            return f"npu_rotary_mul is used on 4-D input here, not {x.ndim}-D (TND tables T1D/TND only)"
        if cos.dtype != x.dtype or sin.dtype != x.dtype:
            return f"npu_rotary_mul's cos/sin dtypes ({cos.dtype}, {sin.dtype}) differ from x's {x.dtype}"
        if cos.shape != sin.shape:
            return f"cos {list(cos.shape)} and sin {list(sin.shape)} differ in shape"
        why = caps.cannot_take("rotary", x.dtype)
        if why:
            return why
        a, b, c, d = x.shape
        layouts = {  # table shape -> (layout, the dims that are B and N)
            (1, 1, c, d): ("BNSD 11SD", (a, b)), (a, 1, c, d): ("BNSD B1SD", (a, b)),
            (a, b, c, d): ("BNSD", (a, b, c)),  # full table: any of the three layouts
            (1, b, 1, d): ("BSND 1S1D", (a, c)), (a, b, 1, d): ("BSND BS1D", (a, c)),
            (a, 1, 1, d): ("SBND S11D", (b, c)),
        }
        found = layouts.get(tuple(cos.shape))
        if found is None:
            return f"cos/sin {list(cos.shape)} is not a documented table layout for x {list(x.shape)}"
        layout, bn = found
        if caps.family in JIT_COMPILE_FAMILIES:
            if d != 128 or max(bn) > 1000:
                return (f"npu_rotary_mul on {FAMILY_NAMES[caps.family]} compiles online "
                        f"(jit_compile=True): needs D == 128 and B, N <= 1000, got x {list(x.shape)}")
            return None
        if d % 2 or d >= 896 or max(bn) >= 1000:
            return f"npu_rotary_mul ({layout}) needs D even and < 896, B and N < 1000; got x {list(x.shape)}"
        return None

    def cannot_fuse_attention(self, spec: AttentionSpec, training: bool) -> str | None:
        """Training: npu_fusion_attention (§1.1 and op-plugin FlashAttentionKernelNpuOpApi.cpp):
        4-D BNSD q/k/v of one dtype the chip takes; query heads 1-256 and a multiple of the key
        heads; Dq == Dk <= 768; key and value of the same shape; keep_prob = 1 - p in (0, 1];
        boolean masks (an additive mask only where it is provably where(keep, 0, -big)).
        Inference keeps SDPA (torch_npu routes it to the fused kernels itself)."""
        if len(spec.q_shape) != 4 or len(spec.k_shape) != 4 or len(spec.v_shape) != 4:
            return "npu_fusion_attention needs 4-D (B, N, S, D) q, k, v"
        if spec.additive_mask is not None and spec.bool_of_additive is None and not spec.is_causal:
            return ("an additive mask that is not provably where(keep, 0, -big) would go in as pse, "
                    "whose shapes the reference does not document; declined (§1.1)")
        if not training:
            if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                return f"npu fused attention does not take {spec.dtype}"
            return _SdpaAttention.cannot_fuse_attention(self, spec, training)  # type: ignore[arg-type]
        why = self.cannot_offer("attention", training=True) or self.cannot_take("attention", spec.dtype)
        if why:
            return why
        k_shape, v_shape = spec.k_shape, spec.v_shape
        if spec.k_grouped is not None:  # GQA runs natively: the kernel sees the grouped k/v
            k_shape, v_shape = _shape_of(spec.k_grouped) or k_shape, _shape_of(spec.v_grouped) or v_shape
        heads = spec.q_shape[1]
        if not 1 <= heads <= FA_MAX_HEADS:
            return f"npu_fusion_attention takes 1-{FA_MAX_HEADS} query heads, not {heads} (§1.1)"
        if k_shape != v_shape:
            return f"npu_fusion_attention needs key and value of one shape, got {list(k_shape)} and {list(v_shape)}"
        d = spec.q_shape[-1]
        if d != k_shape[-1] or d > FA_MAX_HEAD_DIM:
            return f"npu_fusion_attention needs Dq == Dk <= {FA_MAX_HEAD_DIM}, got {d} and {k_shape[-1]} (§1.1)"
        if heads % k_shape[1]:
            return f"query heads {heads} are not a multiple of key/value heads {k_shape[1]} (§1.1)"
        if not 0.0 < 1.0 - spec.dropout_p <= 1.0:
            return f"npu_fusion_attention's keep_prob must be in (0, 1]; dropout {spec.dropout_p} gives {1 - spec.dropout_p}"
        return None

    def _npu_call(self, graph: Graph, op: str, args: tuple, kwargs: dict | None = None,
                  first_output: bool = False) -> Node:
        # torch_npu.<op> is torch.ops.npu.<op>; tensors go positionally (schema names differ
        # from the Chinese docs' names, reference §0.1).
        node = graph.call_function(getattr(self._torch_npu(), op), args, kwargs or {})
        return graph.call_function(operator.getitem, (node, 0)) if first_output else node

    def emit_rms_norm(self, graph: Graph, x: Node, weight: Node | None, eps: float, dim: int) -> Node:
        if weight is None:
            # npu_rms_norm needs gamma (§1.3), on x's device (every input must be an NPU tensor)
            # and of x's dtype (a documented pair on every chip).
            weight = graph.call_method("new_ones", (x, (dim,)))
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
    # boolean mask (torch_npu routes it to its fused kernels, §1.1), except a decode step's
    # attention, which goes to FIA (rewriter.devices.npu_decode_attention says why and when).
    def emit_attention(self, graph: Graph, spec: AttentionSpec, training: bool) -> Node:
        keep = spec.keep_mask if spec.keep_mask is not None else spec.bool_of_additive
        if not training:
            caps = self.capabilities()
            if fia_problem(spec, caps, keep) is not None:
                return _emit_sdpa(graph, spec, keep)
            masked = None
            if keep is not None:  # FIA's one-token mask shape, (B, 1, 1, KV_S)
                masked = graph.call_function(torch.logical_not, (keep,))
                masked = graph.call_method("contiguous", (graph.call_method("expand", (masked, fia_mask_shape(spec))),))
            return emit_fia(graph, self._torch_npu().npu_fused_infer_attention_score, spec,
                            fia_scale_keyword(caps.version), masked)  # type: ignore[union-attr, arg-type]
        kwargs: dict[str, Any] = {"scale": spec.scale, "keep_prob": 1.0 - spec.dropout_p}
        if spec.is_causal:
            # Causal: the compressed 2048x2048 upper-triangular mask with sparse_mode=2 (§1.1),
            # made on q's device: the kernel rejects any tensor that is not on the NPU.
            ones = graph.call_method("new_ones", (spec.q, (2048, 2048)), {"dtype": torch.bool})
            kwargs["atten_mask"] = graph.call_method("triu", (ones, 1))
            kwargs["sparse_mode"] = 2
        elif keep is not None:
            # npu_fusion_attention masks the other way round: True = masked out (§1.1), and
            # takes BNSS, B1SS, 11SS or SS masks only: others are expanded (as torch_npu's SDPA does).
            masked = graph.call_function(torch.logical_not, (keep,))
            shape = documented_mask_shape(spec.mask_shape, spec.q_shape, spec.k_shape)
            if shape is not None:
                masked = graph.call_method("contiguous", (graph.call_method("expand", (masked, shape)),))
            kwargs["atten_mask"] = masked
            if spec.q_shape[2] > 1:
                kwargs["inner_precise"] = 2  # as torch_npu's SDPA passes for masked rows (§1.1)
        # Grouped-query attention runs natively (Nq % Nkv == 0): no repeated k/v needed.
        k = spec.k_grouped if spec.k_grouped is not None else spec.k
        v = spec.v_grouped if spec.v_grouped is not None else spec.v
        fa = graph.call_function(self._torch_npu().npu_fusion_attention,
                                 (spec.q, k, v, spec.q_shape[1], "BNSD"), kwargs)
        return graph.call_function(operator.getitem, (fa, 0))


def _shape_of(node: Any) -> tuple[int, ...] | None:
    info = tensor_info(node)
    return tuple(info.shape) if info is not None else None


def documented_mask_shape(mask: tuple[int, ...] | None, q: tuple[int, ...], k: tuple[int, ...]
                          ) -> tuple[int, ...] | None:
    """The shape to expand a broadcastable mask to so that npu_fusion_attention takes it
    (BNSS, B1SS, 11SS or SS, reference §1.1), or None when it already is one of those."""
    b, n, sq = q[0], q[1], q[2]
    skv = k[2]
    if mask is None:
        return (b, n, sq, skv)
    if mask == (sq, skv) or mask in ((b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv)):
        return None
    m = (1,) * (4 - len(mask)) + tuple(mask)
    mb = b if m[0] == b else 1
    mn = n if m[1] == n else 1
    if mn != 1 and mb == 1:
        mb = b  # 1NSS is not documented: BNSS
    return (mb, mn, sq, skv)


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
