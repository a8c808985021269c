"""Property-based tests: each exact pass keeps outputs and gradients over random inputs it accepts.

For every exact fused-op pass, hypothesis draws shapes, a dtype, the spelling of the pattern and
(attention) a mask; the pass is applied through the fx front-end (``tests.helpers.rewrite``),
must fire, and the rewritten graph must compute what the model computes: outputs, and the
gradients of every floating input and parameter through a fixed cotangent.

Tolerances are relative to the largest value of each compared tensor (the scale the rounding
error is made at): fused kernels reorder reductions, so fp32 differs by a few ulps, never by a
fraction of a value; bf16 gets torch.testing's bf16 bound, as the half-precision floor.
Examples are few and derandomized (a fixed, reproducible set; the suite must run quickly on 2
cores and never flake); raise ``max_examples`` locally to search wider.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rewriter.decide.verify import flatten_output  # noqa: E402
from tests.helpers import code, rewrite  # noqa: E402

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])

FULL = st.sampled_from([torch.float32, torch.float64])
WITH_BF16 = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])

# How far a rewritten result may be from the exact one (float64 arithmetic): at most ACCURACY
# times as far as the original model's own result, plus a floor of some ulps of the largest
# value in the run (where the original happens to round exactly). This is "exact up to
# rounding" stated so that it also holds on ill-conditioned inputs: a layer norm over two
# nearly equal values, or the gradient of a saturated softmax, is a small result of larger
# terms that cancel, and both forms round at the size of those terms, not of the result.
# A wrong formula (scale, eps, mask, bias) is off by orders of magnitude more.
ACCURACY = 4.0
FLOOR = {torch.float32: 16 * torch.finfo(torch.float32).eps,    # ~2e-6 of the largest value
         torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps}   # a few bf16 ulps (~3e-2)
# float64 has no wider reference: the rewrite must match the original to near its precision.
FP64 = {"rtol": 1e-10, "atol": 1e-11}


def assert_as_accurate(name: str, got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor,
                       dtype: torch.dtype, peak: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if not want.is_floating_point():
        assert torch.equal(got, want), name
        return
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=FP64["rtol"], atol=FP64["atol"] * peak,
                                   msg=lambda m: f"{name}: {m}")
        return
    exact = exact.to(torch.float64)
    err_new = float((got.to(torch.float64) - exact).abs().max()) if got.numel() else 0.0
    err_old = float((want.to(torch.float64) - exact).abs().max()) if want.numel() else 0.0
    bound = ACCURACY * err_old + FLOOR[dtype] * peak
    assert err_new <= bound, (f"{name}: the rewrite is {err_new:.3e} from the exact result, "
                              f"the original {err_old:.3e} (bound {bound:.3e}, largest value {peak:.3e})")


def as_float64(model: nn.Module) -> nn.Module:
    """The same model computing in float64 (dtype attributes too), for the exact reference."""
    ref = copy.deepcopy(model).to(torch.float64)
    for m in ref.modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.dtype):
                setattr(m, k, torch.float64)
    return ref


def run_with_grads(fn, inputs: dict[str, torch.Tensor], params: list[tuple[str, nn.Parameter]],
                   differentiate: set[str]):
    """Outputs of ``fn(**inputs)``; gradients of the named inputs and of ``params`` through a
    fixed random cotangent on every floating output."""
    leaves = {k: (v.detach().clone().requires_grad_(True) if k in differentiate else v)
              for k, v in inputs.items()}
    for _, p in params:
        p.grad = None
    out = [t for _, t in flatten_output(fn(**leaves))]
    gen = torch.Generator().manual_seed(1)
    loss = sum((t.float() * torch.randn(t.shape, generator=gen)).sum() for t in out
               if t.is_floating_point())
    loss.backward()
    grads = {f"grad {k}": leaves[k].grad for k in sorted(differentiate)}
    grads.update({f"grad {n}": p.grad.clone() for n, p in params})
    for _, p in params:
        p.grad = None
    assert all(g is not None for g in grads.values()), [k for k, g in grads.items() if g is None]
    return {**{f"output {i}": t.detach() for i, t in enumerate(out)}, **grads}


def check_pass_keeps_numerics(model: nn.Module, inputs: dict[str, torch.Tensor], pass_name: str,
                              dtype: torch.dtype, fused_op: str, sites: int = 1,
                              differentiate: set[str] | None = None) -> None:
    """Apply ``pass_name`` (fx); it must fire ``sites`` times, emit ``fused_op``, and keep the
    outputs and the gradients of the floating inputs (or ``differentiate``) and parameters.
    ``dtype`` is the precision the pattern computes in (it sets the tolerance)."""
    names = list(inputs)
    args = tuple(inputs[n] for n in names)
    cap, found = rewrite(model, args, pass_name, front_end="fx", training=True)
    assert len(found) == sites, f"{pass_name} found {len(found)} site(s), expected {sites}"
    assert fused_op in code(cap), code(cap)
    differentiate = differentiate if differentiate is not None else \
        {n for n, v in inputs.items() if v.is_floating_point()}
    reference = as_float64(model)

    def run(fn, module, tensors):
        return run_with_grads(lambda **kw: fn(*[kw[n] for n in names]), tensors,
                              list(module.named_parameters()), differentiate)
    want = run(model, model, inputs)
    got = run(cap, model, inputs)
    exact = run(reference, reference, {k: v.double() if v.is_floating_point() else v
                                       for k, v in inputs.items()})
    assert got.keys() == want.keys() == exact.keys()
    peak = max(float(t.abs().max()) for t in exact.values() if t.is_floating_point() and t.numel())
    for k in want:
        assert_as_accurate(k, got[k], want[k], exact[k], dtype, peak)


def randn(shape, dtype, gen, magnitude=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * magnitude).to(dtype)


def _coarseness(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


seeds = st.integers(0, 2**16)
magnitudes = st.sampled_from([1e-2, 1.0, 30.0])


# --- fuse_attention ------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, scale: str, mask: str, fill: float) -> None:
        super().__init__()
        self.scale, self.mask, self.fill = scale, mask, fill

    def forward(self, q, k, v, mask=None):
        s = q @ k.transpose(-2, -1)
        if self.scale == "mul":
            s = s * 0.37
        elif self.scale == "div_sqrt_d":
            s = s / math.sqrt(q.size(-1))  # a host scalar from the shape, in the fx graph
        if self.mask == "additive":
            s = s + mask
        elif self.mask == "masked_fill":
            s = s.masked_fill(~mask, self.fill)
        elif self.mask == "where":
            s = torch.where(mask, s, self.fill)
        return F.softmax(s, dim=-1) @ v


@st.composite
def attention_cases(draw):
    batch = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))  # (B,) or (B, heads)
    L, S = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    D, Dv = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    scores = (*batch, L, S)
    mask = draw(st.sampled_from(["none", "additive", "masked_fill", "where"]))
    # A mask shape that broadcasts to the scores: keep some trailing dims, 1 for the others.
    keep_dims = draw(st.lists(st.booleans(), min_size=len(scores), max_size=len(scores)))
    rank = draw(st.integers(2, len(scores)))
    mask_shape = tuple(n if keep else 1 for n, keep in zip(scores, keep_dims))[-rank:]
    return {"batch": tuple(batch), "L": L, "S": S, "D": D, "Dv": Dv, "mask": mask,
            "mask_shape": mask_shape, "scale": draw(st.sampled_from(["mul", "div_sqrt_d", "none"])),
            "fill": draw(st.sampled_from([float("-inf"), -1e9, "finfo.min"])),
            "dtype": draw(WITH_BF16), "seed": draw(seeds), "magnitude": draw(magnitudes)}


@SETTINGS
@given(attention_cases())
def test_fuse_attention_keeps_outputs_and_gradients(case):
    dtype, gen = case["dtype"], torch.Generator().manual_seed(case["seed"])
    b, L, S = case["batch"], case["L"], case["S"]
    inputs = {"q": randn((*b, L, case["D"]), dtype, gen, case["magnitude"]),
              "k": randn((*b, S, case["D"]), dtype, gen),
              "v": randn((*b, S, case["Dv"]), dtype, gen)}
    if case["mask"] != "none":
        keep = torch.rand(case["mask_shape"], generator=gen) > 0.4
        keep[..., 0] = True  # every query sees a key: a fully masked row is NaN in the original
        if case["mask"] == "additive":
            inputs["mask"] = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")) \
                + randn(keep.shape, dtype, gen)
        else:
            inputs["mask"] = keep
    fill = torch.finfo(dtype).min if case["fill"] == "finfo.min" else case["fill"]
    model = Attention(case["scale"], case["mask"], fill)
    differentiate = {"q", "k", "v"}
    check_pass_keeps_numerics(model, inputs, "fuse_attention", dtype,
                              "scaled_dot_product_attention", differentiate=differentiate)


# --- fuse_linear ---------------------------------------------------------------------------

class TransposedMatmul(nn.Module):
    def __init__(self, form: str, d_in: int, d_out: int, bias: bool, dtype, gen) -> None:
        super().__init__()
        self.form = form
        self.w = nn.Parameter(randn((d_out, d_in), dtype, gen) / math.sqrt(d_in))
        self.b = nn.Parameter(randn((d_out,), dtype, gen)) if bias or form == "addmm" else None

    def forward(self, x):
        if self.form == "addmm":
            return torch.addmm(self.b, x, self.w.t())
        wt = {"t": self.w.t(), "T": self.w.T, "transpose": self.w.transpose(0, 1),
              "transpose_neg": self.w.transpose(-1, -2), "permute": self.w.permute(1, 0)}[self.form]
        y = torch.matmul(x, wt) if self.form != "T" else x @ wt
        return y + self.b if self.b is not None else y


@SETTINGS
@given(form=st.sampled_from(["t", "T", "transpose", "transpose_neg", "permute", "addmm"]),
       lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), d_in=st.integers(1, 24),
       d_out=st.integers(1, 24), bias=st.booleans(), dtype=WITH_BF16, seed=seeds)
def test_fuse_linear_keeps_outputs_and_gradients(form, lead, d_in, d_out, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if form == "addmm":
        lead = lead[:1]  # addmm is 2-D
    model = TransposedMatmul(form, d_in, d_out, bias, dtype, gen)
    check_pass_keeps_numerics(model, {"x": randn((*lead, d_in), dtype, gen)}, "fuse_linear",
                              dtype, "linear")


# --- fuse_rms_norm -------------------------------------------------------------------------

class RmsNorm(nn.Module):
    def __init__(self, d: int, weight: bool, upcast: bool, square: str, eps: float, dtype, gen) -> None:
        super().__init__()
        self.weight = nn.Parameter(randn((d,), dtype, gen)) if weight else None
        # LLaMA computes the norm in fp32 (the reference copy computes it in float64)
        self.upcast = torch.float32 if upcast else None
        self.square, self.eps = square, eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(self.upcast) if self.upcast is not None else x
        sq = h.pow(2) if self.square == "pow" else h * h
        h = h * torch.rsqrt(sq.mean(-1, keepdim=True) + self.eps)
        if self.upcast is not None:
            h = h.to(dtype)
        return self.weight * h if self.weight is not None else h


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), d=st.integers(1, 48),
       weight=st.booleans(), upcast=st.booleans(), square=st.sampled_from(["pow", "mul"]),
       eps=st.sampled_from([1e-6, 1e-5, 1e-3]), dtype=WITH_BF16, seed=seeds, magnitude=magnitudes)
def test_fuse_rms_norm_keeps_outputs_and_gradients(lead, d, weight, upcast, square, eps, dtype,
                                                   seed, magnitude):
    gen = torch.Generator().manual_seed(seed)
    model = RmsNorm(d, weight, upcast, square, eps, dtype, gen)
    computes_in = torch.float32 if upcast else dtype  # the upcast computes the norm in fp32
    check_pass_keeps_numerics(model, {"x": randn((*lead, d), dtype, gen, magnitude)},
                              "fuse_rms_norm", max(computes_in, dtype, key=_coarseness), "rms_norm")


# --- fuse_layer_norm -----------------------------------------------------------------------

class LayerNorm(nn.Module):
    def __init__(self, d: int, variance: str, root: str, affine: str, eps: float, dtype, gen) -> None:
        super().__init__()
        self.w = nn.Parameter(randn((d,), dtype, gen)) if affine in ("w", "wb") else None
        self.b = nn.Parameter(randn((d,), dtype, gen)) if affine == "wb" else None
        self.variance, self.root, self.eps = variance, root, eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        if self.variance == "pow":
            v = (x - u).pow(2).mean(-1, keepdim=True)
        elif self.variance == "var":
            v = x.var(-1, keepdim=True, unbiased=False)
        else:
            v = x.var(-1, keepdim=True, correction=0)
        y = (x - u) / torch.sqrt(v + self.eps) if self.root == "div" else (x - u) * torch.rsqrt(v + self.eps)
        if self.w is not None:
            y = self.w * y
        if self.b is not None:
            y = y + self.b
        return y


# Rows of 8 or more: in a row of 2 to 7 random values the spread can be tiny, and the backward's
# terms (each ~ cotangent * w / std) dwarf the gradient they cancel to: that tests the
# conditioning of layer norm, not the rewrite (real hidden sizes are 64 and up).
@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), d=st.integers(8, 48),
       variance=st.sampled_from(["pow", "var", "correction"]), root=st.sampled_from(["div", "rsqrt"]),
       affine=st.sampled_from(["none", "w", "wb"]), eps=st.sampled_from([1e-5, 1e-3]),
       dtype=WITH_BF16, seed=seeds, magnitude=magnitudes, offset=st.sampled_from([0.0, 3.0]))
def test_fuse_layer_norm_keeps_outputs_and_gradients(lead, d, variance, root, affine, eps, dtype,
                                                     seed, magnitude, offset):
    gen = torch.Generator().manual_seed(seed)
    model = LayerNorm(d, variance, root, affine, eps, dtype, gen)
    x = (randn((*lead, d), dtype, gen, magnitude).double() + offset * magnitude).to(dtype)
    check_pass_keeps_numerics(model, {"x": x}, "fuse_layer_norm", dtype, "layer_norm")


# --- fuse_gelu -----------------------------------------------------------------------------

_C = math.sqrt(2.0 / math.pi)


class TanhGelu(nn.Module):
    """transformers' gelu_new, in the spelling ``form`` names."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, x):
        if self.form == "hf":
            return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * torch.pow(x, 3.0))))
        if self.form == "reordered":
            return x * 0.5 * (torch.tanh((0.044715 * x ** 3 + x) * _C) + 1.0)
        return (1 + torch.tanh(_C * (x + 0.044715 * x.pow(3)))) * (x / 2)


@SETTINGS
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       form=st.sampled_from(["hf", "reordered", "halved"]), dtype=WITH_BF16, seed=seeds,
       magnitude=st.sampled_from([1e-2, 1.0, 8.0]))
def test_fuse_gelu_keeps_outputs_and_gradients(shape, form, dtype, seed, magnitude):
    gen = torch.Generator().manual_seed(seed)
    check_pass_keeps_numerics(TanhGelu(form), {"x": randn(shape, dtype, gen, magnitude)},
                              "fuse_gelu", dtype, "approximate = 'tanh'")


# --- fuse_qkv_projections ------------------------------------------------------------------

class Projections(nn.Module):
    def __init__(self, d: int, widths: list[int], bias: bool, dtype) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(d, w, bias=bias, dtype=dtype) for w in widths)

    def forward(self, x):
        return tuple(p(x) for p in self.proj)


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), d=st.integers(1, 24),
       widths=st.lists(st.integers(1, 16), min_size=2, max_size=4), bias=st.booleans(),
       dtype=WITH_BF16, seed=seeds)
def test_fuse_qkv_projections_keeps_outputs_and_gradients(lead, d, widths, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Projections(d, widths, bias, dtype)
    check_pass_keeps_numerics(model, {"x": randn((*lead, d), dtype, gen)},
                              "fuse_qkv_projections", dtype, "torch.cat")


# --- fuse_one_hot --------------------------------------------------------------------------

class OneHotProduct(nn.Module):
    def __init__(self, n: int, d: int, form: str, cast: str, dtype, gen) -> None:
        super().__init__()
        self.n, self.form, self.cast, self.dtype = n, form, cast, dtype
        shape = (n, d) if form == "matmul" else (d, n)
        self.w = nn.Parameter(randn(shape, dtype, gen))
        self.b = nn.Parameter(randn((d,), dtype, gen)) if form == "linear_bias" else None

    def forward(self, idx):
        oh = F.one_hot(idx, self.n)
        oh = oh.to(self.dtype) if self.cast == "to" else oh.type(self.dtype)
        if self.form == "matmul":
            return oh @ self.w
        return F.linear(oh, self.w, self.b)


@SETTINGS
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), n=st.integers(1, 20),
       d=st.integers(1, 12), form=st.sampled_from(["matmul", "linear", "linear_bias"]),
       cast=st.sampled_from(["to", "type"]), dtype=WITH_BF16, seed=seeds)
def test_fuse_one_hot_keeps_outputs_and_gradients(shape, n, d, form, cast, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    model = OneHotProduct(n, d, form, cast, dtype, gen)
    idx = torch.randint(0, n, shape, generator=gen)
    check_pass_keeps_numerics(model, {"idx": idx}, "fuse_one_hot", dtype, "embedding")


# --- pad_to_alignment ----------------------------------------------------------------------

def _near_multiple_of_16(draw) -> int:
    """A size at most 3 below a multiple of 16: padding it adds at most 25%, so it is padded."""
    return 16 * draw(st.integers(1, 4)) - draw(st.integers(0, 3))


class PaddedProduct(nn.Module):
    def __init__(self, form: str, k: int, n: int, bias: bool, dtype, gen) -> None:
        super().__init__()
        self.form = form
        self.w = nn.Parameter(randn((n, k) if form == "linear" else (k, n), dtype, gen))
        self.b = nn.Parameter(randn((n,), dtype, gen)) if bias and form == "linear" else None

    def forward(self, x):
        if self.form == "linear":
            return F.linear(x, self.w, self.b)
        return torch.matmul(x, self.w)


@SETTINGS
@given(data=st.data(), form=st.sampled_from(["linear", "matmul"]),
       lead=st.lists(st.integers(1, 5), min_size=1, max_size=2), bias=st.booleans(),
       dtype=WITH_BF16, seed=seeds)
def test_pad_to_alignment_keeps_outputs_and_gradients(data, form, lead, bias, dtype, seed):
    k, n = _near_multiple_of_16(data.draw), _near_multiple_of_16(data.draw)
    hypothesis.assume(k % 16 or n % 16)  # something to pad
    gen = torch.Generator().manual_seed(seed)
    model = PaddedProduct(form, k, n, bias, dtype, gen)
    check_pass_keeps_numerics(model, {"x": randn((*lead, k), dtype, gen)}, "pad_to_alignment",
                              dtype, "pad")


# --- to_channels_last ----------------------------------------------------------------------

class Conv(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int, groups: int,
                 bias: bool, dtype) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in * groups, c_out * groups, kernel, stride, padding,
                              groups=groups, bias=bias, dtype=dtype)

    def forward(self, x):
        return F.relu(self.conv(x))


@SETTINGS
@given(batch=st.integers(1, 3), c_in=st.integers(1, 4), c_out=st.integers(1, 4),
       groups=st.sampled_from([1, 2]), kernel=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]),
       padding=st.sampled_from([0, 1]), hw=st.integers(3, 9), bias=st.booleans(), dtype=FULL,
       seed=seeds)
def test_to_channels_last_keeps_outputs_and_gradients(batch, c_in, c_out, groups, kernel, stride,
                                                      padding, hw, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Conv(c_in, c_out, kernel, stride, padding, groups, bias, dtype)
    x = randn((batch, c_in * groups, hw, hw + 1), dtype, gen)
    check_pass_keeps_numerics(model, {"x": x}, "to_channels_last", dtype, "channels_last")


# --- make_contiguous -----------------------------------------------------------------------

class StridedGemms(nn.Module):
    def __init__(self, view: str, d: int, widths: list[int], dtype, gen) -> None:
        super().__init__()
        self.view = view
        self.w = nn.ParameterList(nn.Parameter(randn((d, w), dtype, gen)) for w in widths)

    def forward(self, x):  # x (B, d, L): the view is (B, L, d), read by every GEMM
        v = x.transpose(1, 2) if self.view == "transpose" else x.permute(0, 2, 1)
        return tuple(v @ w for w in self.w) + (v * 2,)


@SETTINGS
@given(view=st.sampled_from(["transpose", "permute"]), batch=st.integers(1, 3), d=st.integers(2, 12),
       length=st.integers(2, 9), widths=st.lists(st.integers(1, 8), min_size=1, max_size=3),
       dtype=WITH_BF16, seed=seeds)
def test_make_contiguous_keeps_outputs_and_gradients(view, batch, d, length, widths, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    model = StridedGemms(view, d, widths, dtype, gen)
    check_pass_keeps_numerics(model, {"x": randn((batch, d, length), dtype, gen)},
                              "make_contiguous", dtype, "contiguous")


# --- narrow_int64 --------------------------------------------------------------------------

class PositionArithmetic(nn.Module):
    """Position ids from ``arange`` through int arithmetic into an embedding and a mask."""

    def __init__(self, vocab: int, offset: int, factor: int, divisor: int, dtype, gen) -> None:
        super().__init__()
        self.weight = nn.Parameter(randn((vocab, 4), dtype, gen))
        self.vocab, self.offset, self.factor, self.divisor = vocab, offset, factor, divisor

    def forward(self, x):
        pos = torch.arange(x.size(1)) * self.factor + self.offset
        ids = (pos // self.divisor) % self.vocab
        keep = pos[None, :] <= pos[:, None]
        return F.embedding(ids, self.weight) * x.unsqueeze(-1), keep, ids


@SETTINGS
@given(batch=st.integers(1, 3), length=st.integers(1, 12), vocab=st.integers(1, 50),
       offset=st.integers(-5, 5), factor=st.integers(1, 1000), divisor=st.integers(1, 7),
       dtype=FULL, seed=seeds)
def test_narrow_int64_keeps_outputs_and_gradients(batch, length, vocab, offset, factor, divisor,
                                                  dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    model = PositionArithmetic(vocab, offset, factor, divisor, dtype, gen)
    check_pass_keeps_numerics(model, {"x": randn((batch, length), dtype, gen)}, "narrow_int64",
                              dtype, "int32")
