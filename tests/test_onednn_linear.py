"""onednn_linear: fp32 F.linear on CPU through oneDNN, forward and backward (custom ops)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rewriter.devices import onednn_linear as dnn
from rewriter.devices.backends import CpuBackend
from rewriter.pass_api import PassContext, registered_passes
from tests.helpers import code, outputs_and_grads, rewrite

pytestmark = pytest.mark.skipif(dnn.unavailable() is not None, reason=str(dnn.unavailable()))


def _bar(k: int) -> dict:
    """fp32 against a float64 reference, for a sum of ``k`` products of unit normals: the
    summation error bound (k unit roundoffs) of the sum's typical size (sqrt(k)), times 4."""
    return dict(rtol=0, atol=4 * k * 2.0 ** -24 * k ** 0.5)


def _grads(fn, x, w, b):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    out = fn(*leaves) if b is not None else fn(*leaves, None)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(cot)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(64,), (3, 40, 64)])
def test_forward_and_backward_agree_with_a_float64_reference(bias, shape):
    torch.manual_seed(0)
    x, w = torch.randn(*shape, 256)[..., :64].contiguous(), torch.randn(96, 64)
    b = torch.randn(96) if bias else None
    ours, stock = _grads(dnn.linear, x, w, b), _grads(F.linear, x, w, b)
    ref = _grads(F.linear, x.double(), w.double(), None if b is None else b.double())
    tokens = x.numel() // 64
    # the output and grad_input sum over the 64 inputs / 96 outputs, grad_weight over the tokens
    for got, base, want, k in zip(ours, stock, ref, (64, 96, tokens, tokens)):
        torch.testing.assert_close(base.double(), want, **_bar(k))  # the bar stock fp32 meets
        torch.testing.assert_close(got.double(), want, **_bar(k))


def test_transposed_views_and_an_input_without_grad():
    """A non-contiguous input and a tied, transposed weight; no grad for x: none computed."""
    torch.manual_seed(0)
    x = torch.randn(64, 32).t()                     # (32, 64), strides (1, 32)
    w = torch.randn(64, 48, requires_grad=True)     # used as its transpose: (48, 64)
    y = dnn.linear(x, w.t())
    y.sum().backward()
    w64 = w.detach().double().requires_grad_()
    want = F.linear(x.double(), w64.t())
    want.sum().backward()
    torch.testing.assert_close(y.double(), want, **_bar(64))
    torch.testing.assert_close(w.grad.double(), w64.grad, **_bar(32))


@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 16)])
def test_the_output_may_be_modified_in_place_under_autograd(shape):
    """Falcon adds its bias in place to a linear's output."""
    torch.manual_seed(0)
    x, w, b = torch.randn(*shape), torch.randn(8, 16, requires_grad=True), torch.randn(8)
    y = dnn.linear(x, w)
    y += b
    y.sum().backward()
    w64 = w.detach().double().requires_grad_()
    want = F.linear(x.double(), w64) + b.double()
    want.sum().backward()
    torch.testing.assert_close(y.double(), want, **_bar(16))
    torch.testing.assert_close(w.grad.double(), w64.grad, **_bar(6))


@pytest.mark.parametrize("case", ["bf16", "float64", "empty", "shape"])
def test_what_onednn_does_not_take_is_f_linear_unchanged(case):
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)
    if case == "bf16":
        x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
    elif case == "float64":
        x, w, b = x.double(), w.double(), b.double()
    elif case == "empty":
        x = x[:0]
    else:
        w = torch.randn(4, 12)                      # F.linear raises its own error
    assert not dnn.runs_on_onednn(x, w, b)
    try:
        want = F.linear(x, w, b)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=str(e)[:30]):
            dnn.linear(x, w, b)
        return
    torch.testing.assert_close(dnn.linear(x, w, b), want, rtol=0, atol=0)


def test_a_compiled_graph_keeps_the_custom_ops():
    """Inductor's own lowering of oneDNN's linear wants a frozen weight; the custom ops are
    opaque to it, so a trained weight compiles, and forward and backward match eager."""
    torch.manual_seed(0)
    x, w, b = torch.randn(16, 32), torch.randn(24, 32), torch.randn(24)

    def f(x, w, b):
        return torch.tanh(dnn.linear(x, w, b))

    graphs = []

    def inductor_recording(gm, example_inputs):
        graphs.append(str(gm.code))
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=inductor_recording)
    for got, want in zip(_grads(compiled, x, w, b), _grads(f, x, w, b)):
        torch.testing.assert_close(got, want, **_bar(32))
    assert any("onednn_linear" in g for g in graphs)


def _assert_matches(cap, model, x, k_out, k_grads):
    """The rewritten capture's output and parameter gradients against the model's own, at the
    fp32 bar of sums ``k_out`` and ``k_grads`` long."""
    params = list(model.parameters())
    got_out, got_grads = outputs_and_grads(cap, (x,), params)
    want_out, want_grads = outputs_and_grads(model, (x,), params)
    torch.testing.assert_close(got_out, want_out, **_bar(k_out))
    torch.testing.assert_close(got_grads, want_grads, **_bar(k_grads))


class Mlp(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.up = nn.Linear(32, 64, dtype=dtype)
        self.down = nn.Linear(64, 32, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_the_pass_rewrites_each_fp32_linear(front_end):
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(4, 10, 32)
    cap, sites = rewrite(model, (x,), "onednn_linear", front_end=front_end, training=True)
    assert sorted(s.description.split(": ")[1] for s in sites) == ["linear 32->64", "linear 64->32"]
    assert "linear" in code(cap) and "onednn" in code(cap)
    _assert_matches(cap, model, x, k_out=64, k_grads=40)


class Conv1DStyle(nn.Module):
    """GPT-2's Conv1D (``addmm(b, x, v)``, ``v`` stored (in, out)) and a bare ``x @ v``."""

    def __init__(self):
        super().__init__()
        self.v1, self.b1 = nn.Parameter(torch.randn(32, 48) * 0.1), nn.Parameter(torch.randn(48))
        self.v2 = nn.Parameter(torch.randn(48, 16) * 0.1)

    def forward(self, x):
        h = torch.addmm(self.b1, x.reshape(-1, 32), self.v1)
        return torch.tanh(h) @ self.v2


def test_the_pass_rewrites_addmm_and_matmul_by_a_stored_in_out_weight():
    torch.manual_seed(0)
    model, x = Conv1DStyle(), torch.randn(3, 7, 32)
    cap, sites = rewrite(model, (x,), "onednn_linear", training=True)
    assert sorted(s.description.split(": ")[1] for s in sites) == ["linear 32->48", "linear 48->16"]
    assert "addmm" not in code(cap) and "matmul" not in code(cap)
    _assert_matches(cap, model, x, k_out=48, k_grads=48)


def test_linears_reading_each_other_directly_are_all_rewritten():
    """A site's input is the previous site's output (no op between): the later replacement
    reads the earlier one's, not the erased original (the rule driver's apply, in graph order)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 24), nn.Linear(24, 8)), torch.randn(5, 16)
    cap, sites = rewrite(model, (x,), "onednn_linear", training=True)
    assert len(sites) == 3
    _assert_matches(cap, model, x, k_out=32, k_grads=32)


def test_no_site_in_float64_and_none_with_onednn_disabled():
    _, sites = rewrite(Mlp(torch.float64), (torch.randn(4, 32, dtype=torch.float64),), "onednn_linear")
    assert sites == []
    p = registered_passes()["onednn_linear"]
    assert p.applies_to(PassContext(CpuBackend(), True)) is None
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)  # as torch.backends.mkldnn.flags(enabled=False) sets it
    try:
        assert "disabled" in p.applies_to(PassContext(CpuBackend(), True))
    finally:
        torch._C._set_mkldnn_enabled(was)
