"""What one operator call must compute and move: FLOPs, and bytes read and written.

From the names, input shapes, dtypes and scalar arguments a profiler records (torch.profiler
with ``record_shapes``; torch_npu's ``kernel_details.csv``), so the roofline can say how good a
call was::

    from rewriter.profile.opcost import op_cost

    op_cost("aten::mm", ((256, 1000), (1000, 1000)), ("float", "float"))
    # OpCost(flops=512000000.0, bytes=6048000.0, kind='gemm')

FLOPs: GEMM, convolution and attention by ``torch.utils.flop_counter``'s formulas (2 per
multiply-add: ``2*M*N*K`` for a matmul); element-wise operators one FLOP per output element,
reductions and norms one per input element (a stated convention, not a count of instructions).
Copies and layout changes have no FLOPs, only bytes.

Bytes: every input tensor read once and the output written once, from tensor sizes; a lower
bound (caches that miss, re-reads of a GEMM's tiles and workspace make real traffic larger), so
the achieved bandwidth derived from it is a lower bound too. An output whose shape the profile
does not give (reductions) counts as nothing.

Operators without a rule (views, allocation, indexing, communication) have no cost: ``None``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from torch.utils import flop_counter

__all__ = ["OpCost", "op_cost", "itemsize", "KINDS"]

Shape = tuple[int, ...]

KINDS = ("gemm", "conv", "attention", "elementwise", "reduction", "copy")


@dataclass(frozen=True)
class OpCost:
    """One call's work: ``flops``, ``bytes`` (read + written, a lower bound) and its ``kind``
    (one of :data:`KINDS`)."""

    flops: float
    bytes: float
    kind: str

    @property
    def intensity(self) -> float:
        """FLOPs per byte (arithmetic intensity)."""
        return self.flops / self.bytes if self.bytes else math.inf


# Byte sizes of the dtype spellings of torch.profiler (``input_dtypes``) and of torch_npu's
# kernel_details.csv (``Input Data Types``, §3.3).
_ITEMSIZE = {
    "float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::float8_e4m3fn": 1,
    "c10::float8_e5m2": 1, "c10::complex<float>": 8,
    "float32": 4, "float16": 2, "bf16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "float64": 8, "dt_bf16": 2,
}
DEFAULT_ITEMSIZE = 4  # a call whose dtypes the profile did not record: assumed fp32


def itemsize(dtype: str | None) -> int:
    """Bytes per element of a profiler dtype string (``"float"``, ``"c10::BFloat16"``,
    ``"FLOAT16"``); 4 when unknown::

        itemsize("c10::Half")  # 2
    """
    return _ITEMSIZE.get((dtype or "").strip().lower(), DEFAULT_ITEMSIZE)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def _broadcast(shapes: Sequence[Shape]) -> Shape:
    dims = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(-dims, 0):
        sizes = [s[i] for s in shapes if len(s) >= -i]
        out.append(max(sizes) if sizes else 1)
    return tuple(out)


# --- the operator families --------------------------------------------------------------------

_GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
# Convolution leaves by their argument order: (stride, padding, dilation) positions, or the
# registry's own formula (which takes shapes) for the rest.
_CONV_ARGS = {  # name: (stride index, padding index, dilation index, transposed index | None)
    "convolution": (3, 4, 5, 6), "_convolution": (3, 4, 5, 6), "convolution_overrideable": (3, 4, 5, 6),
    "mkldnn_convolution": (4, 3, 5, None), "_slow_conv2d_forward": (4, 5, None, None),
    "thnn_conv2d": (4, 5, None, None), "cudnn_convolution": (4, 3, 5, None),
    "_nnpack_spatial_convolution": (4, 3, None, None), "slow_conv3d_forward": (4, 5, None, None),
}
_CONV_BACKWARD = {"convolution_backward"}
_ATTENTION = {  # (q, k, v) positions; backward: (grad_out, q, k, v)
    "_scaled_dot_product_flash_attention_for_cpu": "fwd", "_scaled_dot_product_flash_attention": "fwd",
    "_scaled_dot_product_efficient_attention": "fwd", "_scaled_dot_product_cudnn_attention": "fwd",
    "_flash_attention_forward": "fwd", "_efficient_attention_forward": "fwd",
    "_scaled_dot_product_fused_attention_overrideable": "fwd",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "bwd_go_first",
    "_scaled_dot_product_flash_attention_backward": "bwd_go_first",
    "_scaled_dot_product_efficient_attention_backward": "bwd_go_first",
    "_scaled_dot_product_cudnn_attention_backward": "bwd_go_first",
    "_flash_attention_backward": "bwd_go_first", "_efficient_attention_backward": "bwd_go_first",
}
_ELEMENTWISE = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "pow", "sqrt", "rsqrt",
    "exp", "log", "tanh", "sigmoid", "relu", "relu_", "clamp_min", "clamp", "gelu", "silu",
    "silu_", "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward",
    "tanh_backward", "where", "masked_fill", "masked_fill_", "addcmul_", "addcdiv_", "lerp_",
    "sqrt_", "fill_", "zero_", "native_dropout", "dropout", "native_dropout_backward", "abs",
    "maximum", "minimum", "reciprocal", "sin", "cos", "erf", "hardtanh", "leaky_relu",
    "_foreach_add_", "_foreach_mul_", "eq", "ne", "gt", "lt", "ge", "le", "rotary_mul",
    "bernoulli_", "uniform_", "normal_", "pow_", "tanh_", "exp_",
}
_REDUCTION = {
    "sum", "mean", "amax", "max", "min", "var_mean", "var", "std", "norm", "linalg_vector_norm",
    "_softmax", "softmax", "_log_softmax", "log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_fused_rms_norm", "rms_norm", "nll_loss_forward", "nll_loss_backward", "cumsum", "argmax",
    "_fused_adamw_", "_fused_adam_", "_fused_sgd_", "npu_rms_norm",
}
_COPY = {"copy_", "_to_copy", "contiguous", "clone", "cat", "stack", "index_select", "embedding",
         "embedding_dense_backward", "gather", "_unsafe_view_copy", "constant_pad_nd", "repeat"}
# NPU kernel types (CANN, kernel_details.csv) -> the aten family they compute.
_NPU_TYPES = {
    "matmul": "mm", "matmulv2": "mm", "matmulv3": "mm", "batchmatmul": "bmm", "batchmatmulv2": "bmm",
    "batchmatmulv3": "bmm", "conv2d": "npu_conv", "conv3d": "npu_conv", "flashattentionscore": "npu_fa",
    "flashattentionscoregrad": "npu_fa_grad", "realdiv": "div", "relu": "relu", "gelu": "gelu",
    "fastgelu": "gelu", "cast": "_to_copy", "transdata": "copy_", "tensormove": "copy_",
    "identity": "copy_", "concatd": "cat", "softmaxv2": "_softmax", "layernorm": "native_layer_norm",
    "layernormv3": "native_layer_norm", "layernormv4": "native_layer_norm", "reducesum": "sum",
    "reducesumd": "sum", "reducemean": "mean", "rmsnorm": "npu_rms_norm", "swiglu": "mul",
    "asstrided": "copy_", "viewcopy": "copy_", "add": "add", "mul": "mul", "sub": "sub",
    "adds": "add", "muls": "mul", "applyadamwv2": "_fused_adamw_", "zeroslike": "zero_",
}


def _short(name: str) -> str:
    """``aten::mm`` / ``aten::add_.Tensor`` / ``MatMulV2`` -> the family name used above."""
    base = name.split("::", 1)[-1].split(".", 1)[0]
    if "::" not in name and base.lower() in _NPU_TYPES:  # an NPU kernel type
        return _NPU_TYPES[base.lower()]
    return base


def _tensor_bytes(shapes: Sequence[Shape], dtypes: Sequence[str], positions: Sequence[int] | None = None
                  ) -> float:
    idx = range(len(shapes)) if positions is None else positions
    total = 0.0
    for i in idx:
        if i < len(shapes) and shapes[i]:
            total += _numel(shapes[i]) * itemsize(dtypes[i] if i < len(dtypes) else None)
    return total


def _is_tensor(i: int, shapes: Sequence[Shape], dtypes: Sequence[str]) -> bool:
    if i >= len(shapes):
        return False
    if shapes[i]:
        return True
    # a 0-d tensor has shape () too; the dtype tells it from a scalar
    d = dtypes[i] if i < len(dtypes) else ""
    return bool(d) and d not in ("Scalar", "ScalarList", "TensorList", "")


def _out_dtype(dtypes: Sequence[str]) -> str | None:
    return next((d for d in dtypes if d and d not in ("Scalar", "ScalarList", "TensorList")), None)


def _gemm(op: str, shapes: Sequence[Shape], dtypes: Sequence[str]) -> OpCost | None:
    first = 1 if op in ("addmm", "baddbmm") else 0
    if len(shapes) < first + 2 or not shapes[first] or not shapes[first + 1]:
        return None
    a, b = shapes[first], shapes[first + 1]
    if op in ("mm", "addmm", "_scaled_mm"):
        if len(a) != 2 or len(b) != 2:
            return None
        out: Shape = (a[0], b[1])
        flops = flop_counter.mm_flop(a, b)
    else:
        if len(a) != 3 or len(b) != 3:
            return None
        out = (a[0], a[1], b[2])
        flops = flop_counter.bmm_flop(a, b)
    if first and shapes[0]:
        flops += _numel(out)  # the added input: one add per output element
    read = _tensor_bytes(shapes, dtypes, range(first + 2) if first else (0, 1))
    return OpCost(float(flops), read + _numel(out) * itemsize(_out_dtype(dtypes)), "gemm")


def _npu_gemm(shapes: Sequence[Shape], dtypes: Sequence[str], out_shapes: Sequence[Shape]) -> OpCost | None:
    """MatMul kernels record no transpose flags: K is the dimension both inputs share."""
    if len(shapes) < 2 or len(shapes[0]) < 2 or len(shapes[1]) < 2:
        return None
    a, b = shapes[0], shapes[1]
    batch = _numel(a[:-2])
    for m, k, k2, n in ((a[-2], a[-1], b[-2], b[-1]), (a[-2], a[-1], b[-1], b[-2]),
                        (a[-1], a[-2], b[-2], b[-1]), (a[-1], a[-2], b[-1], b[-2])):
        if k == k2:
            out = (batch * m * n,)
            read = _tensor_bytes(shapes, dtypes)
            written = _numel(out_shapes[0]) if out_shapes and out_shapes[0] else _numel(out)
            return OpCost(2.0 * batch * m * n * k, read + written * itemsize(_out_dtype(dtypes)), "gemm")
    return None


def _conv_out(x: Shape, w: Shape, stride: Any, padding: Any, dilation: Any, transposed: bool) -> Shape | None:
    spatial = len(x) - 2
    if spatial < 1 or len(w) != len(x):
        return None

    def per_dim(v: Any, default: int) -> list[int]:
        if v is None:
            return [default] * spatial
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        return v * spatial if len(v) == 1 else v

    s, p, d = per_dim(stride, 1), per_dim(padding, 0), per_dim(dilation, 1)
    if not all(isinstance(t, int) for t in s + p + d):
        return None
    if transposed:  # w: (C_in, C_out/groups, k...); output_padding left out (a lower bound)
        dims = [(x[2 + i] - 1) * s[i] - 2 * p[i] + d[i] * (w[2 + i] - 1) + 1 for i in range(spatial)]
        return (x[0], w[1], *dims)
    dims = [(x[2 + i] + 2 * p[i] - d[i] * (w[2 + i] - 1) - 1) // s[i] + 1 for i in range(spatial)]
    return (x[0], w[0], *dims)


def _conv(op: str, shapes: Sequence[Shape], dtypes: Sequence[str], concrete: Sequence[Any]) -> OpCost | None:
    if len(shapes) < 2 or not shapes[0] or not shapes[1]:
        return None
    si, pi, di, ti = _CONV_ARGS[op]

    def arg(i: int | None) -> Any:
        return concrete[i] if i is not None and i < len(concrete) else None

    transposed = bool(arg(ti))
    out = _conv_out(shapes[0], shapes[1], arg(si), arg(pi), arg(di), transposed)
    if out is None:
        return None
    flops = flop_counter.conv_flop_count(list(shapes[0]), list(shapes[1]), list(out), transposed)
    if len(shapes) > 2 and shapes[2]:
        flops += _numel(out)  # bias
    read = _tensor_bytes(shapes, dtypes, (0, 1, 2))
    return OpCost(float(flops), read + _numel(out) * itemsize(_out_dtype(dtypes)), "conv")


def _conv_backward(shapes: Sequence[Shape], dtypes: Sequence[str], concrete: Sequence[Any]) -> OpCost | None:
    # convolution_backward(grad_out, input, weight, bias_sizes, stride, padding, dilation,
    #                      transposed, output_padding, groups, output_mask)
    if len(shapes) < 3 or not all(shapes[:3]):
        return None
    mask = concrete[10] if len(concrete) > 10 and isinstance(concrete[10], (list, tuple)) else [True, True, True]
    transposed = bool(concrete[7]) if len(concrete) > 7 else False
    formula = flop_counter.flop_registry[flop_counter.aten.convolution_backward]
    grads = (shapes[1] if mask[0] else None, shapes[2] if mask[1] else None, None)
    flops = formula(shapes[0], shapes[1], shapes[2], None, None, None, None, transposed, None, None,
                    list(mask), out_val=grads)
    read = _tensor_bytes(shapes, dtypes, (0, 1, 2))
    written = sum(_numel(s) * itemsize(_out_dtype(dtypes)) for s, m in zip(shapes[1:3], mask[:2]) if m)
    return OpCost(float(flops), read + written, "conv")


def _attention(mode: str, shapes: Sequence[Shape], dtypes: Sequence[str]) -> OpCost | None:
    if mode == "fwd":
        if len(shapes) < 3 or not all(len(s) == 4 for s in shapes[:3]):
            return None
        q, k, v = shapes[:3]
        flops = flop_counter.sdpa_flop_count(q, k, v)
        out = (*q[:-1], v[-1])
        read = _tensor_bytes(shapes, dtypes, (0, 1, 2))
        return OpCost(float(flops), read + _numel(out) * itemsize(_out_dtype(dtypes)), "attention")
    if len(shapes) < 4 or not all(len(s) == 4 for s in shapes[:4]):
        return None
    go, q, k, v = shapes[:4]
    flops = flop_counter.sdpa_backward_flop_count(go, q, k, v)
    read = _tensor_bytes(shapes, dtypes, range(min(len(shapes), 6)))
    written = (_numel(q) + _numel(k) + _numel(v)) * itemsize(_out_dtype(dtypes))
    return OpCost(float(flops), read + written, "attention")


def _npu_attention(backward: bool, shapes: Sequence[Shape], dtypes: Sequence[str]) -> OpCost | None:
    """FlashAttentionScore: layouts BSH/BSND/BNSD/SBH are not in the CSV; with 4-D BNSD inputs
    (the layout the fuse_attention pass emits) the formula is SDPA's, else no cost."""
    if len(shapes) < 3 or not all(len(s) == 4 for s in shapes[:3]):
        return None
    if backward:
        return _attention("bwd_go_first", (shapes[3] if len(shapes) > 3 else shapes[0], *shapes[:3]),
                          dtypes)
    return _attention("fwd", shapes, dtypes)


def op_cost(name: str, shapes: Sequence[Shape], dtypes: Sequence[str] = (), concrete: Sequence[Any] = (),
            out_shapes: Sequence[Shape] = ()) -> OpCost | None:
    """FLOPs and bytes of one call of ``name`` with these input ``shapes`` (``()`` for a
    non-tensor input), ``dtypes`` (profiler spellings) and ``concrete`` scalar arguments
    (torch.profiler's ``concrete_inputs``: a convolution's stride and padding); ``out_shapes``
    where the profile records them (NPU). None for operators without a rule::

        op_cost("aten::add", ((8, 64), (8, 64), ()), ("float", "float", "Scalar"))
        # OpCost(flops=512.0, bytes=6144.0, kind='elementwise')
    """
    op = _short(name)
    shapes = [tuple(s) if s else () for s in shapes]
    dtypes = list(dtypes)
    out_shapes = [tuple(s) for s in out_shapes if s]
    if "::" not in name and op in ("mm", "bmm"):  # an NPU MatMul kernel: no transpose flags
        return _npu_gemm(shapes, dtypes, out_shapes)
    if op in _GEMM:
        return _gemm(op, shapes, dtypes)
    if op in _CONV_ARGS:
        return _conv(op, shapes, dtypes, concrete)
    if op in _CONV_BACKWARD:
        return _conv_backward(shapes, dtypes, concrete)
    if op in _ATTENTION:
        return _attention("fwd" if _ATTENTION[op] == "fwd" else "bwd", shapes, dtypes)
    if op in ("npu_fa", "npu_fa_grad"):
        return _npu_attention(op == "npu_fa_grad", shapes, dtypes)
    if op == "npu_conv" and out_shapes and len(shapes) > 1 and shapes[1]:
        w = shapes[1]
        flops = 2.0 * _numel(out_shapes[0]) * _numel(w[1:])
        return OpCost(flops, _tensor_bytes(shapes, dtypes) + _numel(out_shapes[0]) *
                      itemsize(_out_dtype(dtypes)), "conv")
    tensors = [s for i, s in enumerate(shapes) if _is_tensor(i, shapes, dtypes)]
    if not tensors:
        return None
    read = _tensor_bytes(shapes, dtypes, [i for i in range(len(shapes)) if _is_tensor(i, shapes, dtypes)])
    size = itemsize(_out_dtype(dtypes))
    if op in _ELEMENTWISE:
        out = out_shapes[0] if out_shapes else _broadcast(tensors)
        return OpCost(float(_numel(out)), read + _numel(out) * size, "elementwise")
    if op in _REDUCTION:
        out = out_shapes[0] if out_shapes else (tensors[0] if op in _SAME_SHAPE else ())
        written = _numel(out) * size if out else 0.0
        return OpCost(float(_numel(tensors[0])), read + written, "reduction")
    if op in _COPY:
        if op in ("index_select", "embedding", "gather"):  # reads what it writes, not the table
            out = out_shapes[0] if out_shapes else ()
            moved = 2.0 * _numel(out) * size if out else _tensor_bytes(shapes, dtypes, (1,)) * 2
            return OpCost(0.0, moved, "copy")
        if op == "copy_":  # copy_(dst, src): src read, dst written: both inputs, once each
            return OpCost(0.0, read, "copy")
        out_elems = _numel(out_shapes[0]) if out_shapes else sum(_numel(t) for t in tensors)
        return OpCost(0.0, read + out_elems * size, "copy")
    return None


# Reductions whose output has the input's shape (softmax, norms and their backward).
_SAME_SHAPE = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_softmax_backward_data",
               "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward",
               "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
               "_fused_rms_norm", "rms_norm", "cumsum", "npu_rms_norm", "_fused_adamw_",
               "_fused_adam_", "_fused_sgd_"}
