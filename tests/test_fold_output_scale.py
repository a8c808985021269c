"""fold_output_scale: a number scaling a Linear's wide output moved to its input, outputs and
gradients kept (bit for bit where the number is a power of two), and what is not a site."""
import pytest
import torch
import torch.nn as nn

from rewriter.pass_api import PassContext, registered_passes
from rewriter.devices.backends import CpuBackend
from rewriter.capture.front_ends import capture
from tests.helpers import code, outputs_and_grads, rewrite

FORMS = {"div": lambda y, c: y / c, "mul": lambda y, c: y * c, "rmul": lambda y, c: c * y,
         "div_inplace": lambda y, c: y.div_(c)}


class ScaledHead(nn.Module):
    def __init__(self, form: str, c: float, bias: bool = True, d_in: int = 16, d_out: int = 64):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=bias)
        self.form, self.c = form, c

    def forward(self, x):
        return FORMS[self.form](self.lin(x), self.c)


def _compare(cap, model, x, exact: bool):
    params = list(model.parameters())
    got, want = (sum(outputs_and_grads(f, (x,), params), []) for f in (cap, model))
    assert len(got) == len(want) == 2 + len(params)
    for g, w in zip(got, want):
        if exact:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        else:  # one rounding moved, over a 16-long dot product (and its backward's)
            torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("c", [8.0, 0.0625, 0.3, 1.0])
def test_scale_moved_to_the_input(form, c, bias):
    torch.manual_seed(0)
    model = ScaledHead(form, c, bias)
    x = torch.randn(2, 5, 16)
    cap, sites = rewrite(model, (x,), "fold_output_scale", training=True)
    assert len(sites) == 1, sites
    assert "linear 16->64" in sites[0].description
    lines = [ln for ln in code(cap).splitlines() if "=" in ln and "return" not in ln]
    linear_at = next(i for i, ln in enumerate(lines) if "linear" in ln)
    # nothing computes on the Linear's output any more; the input is scaled unless c is 1
    assert not any(op in ln for ln in lines[linear_at + 1:] for op in ("mul", "truediv", "div"))
    scaled_first = any(op in ln for ln in lines[:linear_at] for op in ("mul", "truediv", "div"))
    assert scaled_first == (c != 1.0), lines
    # a power of two (1 included) commutes with the GEMM bit for bit; 0.3 moves one rounding
    _compare(cap, model, x, exact=c in (8.0, 0.0625, 1.0))


def test_dynamo_front_end_with_a_constant_scale():
    model = ScaledHead("div", 8.0)
    x = torch.randn(3, 16)
    torch._dynamo.reset()
    cap, sites = rewrite(model, (x,), "fold_output_scale", front_end="dynamo", training=True)
    assert len(sites) == 1
    _compare(cap, model, x, exact=True)


class NotSites(nn.Module):
    """Linears whose scaled outputs are not this pass's: each case returns its result."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.wide, self.narrow = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x, y):
        c = self.case
        if c == "narrowing":  # the output not wider than the input: nothing to save
            return self.narrow(y) * 4.0
        if c == "tensor_scale":  # SwiGLU's up(x) * silu(gate(x)): a tensor, not a scale
            return self.wide(x) * y
        if c == "cast_between":  # the scale would move into another precision
            return self.wide(x).double() / 8.0
        if c == "read_elsewhere":  # the unscaled output is also returned
            z = self.wide(x)
            return z / 8.0, z
        if c == "floor_division":
            return torch.div(self.wide(x), 8.0, rounding_mode="floor")
        if c == "reciprocal":  # c / linear is not a scale of it
            return 8.0 / self.wide(x)
        if c == "softcap":  # Gemma-2's logit cap: fuse_linear_cross_entropy's, whole
            return torch.tanh(self.wide(x) / 30.0) * 30.0
        raise AssertionError(c)


@pytest.mark.parametrize("case", ["narrowing", "tensor_scale", "cast_between", "read_elsewhere", "floor_division",
                                  "reciprocal", "softcap"])
def test_not_a_site(case):
    model = NotSites(case)
    args = (torch.randn(3, 16), torch.randn(3, 64))
    cap, sites = rewrite(model, args, "fold_output_scale")
    assert sites == []
    torch.testing.assert_close(cap(*args), model(*args))


def test_zero_scale_declined_with_its_reason():
    model = ScaledHead("mul", 0.0)
    cap = capture(model, (torch.randn(3, 16),), {}, "fx")
    ctx = PassContext(CpuBackend(), False)
    assert registered_passes()["fold_output_scale"].find(cap.slots[0].kept, ctx) == []
    assert any("scale is 0.0" in why for why in ctx.declined), ctx.declined


def _tiny_lm(config_name: str, model_name: str, **scale):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager", **scale)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).train()


@pytest.mark.parametrize("config_name, model_name, scale, shown, exact", [
    ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}, "/ 8", True),
    ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 3.0}, "/ 3", False),
    ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.0625}, "* 0.0625", True),
])
def test_language_model_logit_scales(config_name, model_name, scale, shown, exact):
    """transformers' own modeling code: Granite divides its logits, Cohere multiplies them."""
    model = _tiny_lm(config_name, model_name, **scale)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids, "labels": ids}
    torch._dynamo.reset()
    cap, sites = rewrite(model, (), "fold_output_scale", front_end="dynamo", training=True, kwargs=kwargs)
    assert [s.description.split(": ", 1)[1] for s in sites] == [f"linear 32->128 {shown}"]
    params = list(model.parameters())
    got, want = (sum(outputs_and_grads(lambda **k: f(**k), (), params, kwargs), []) for f in (cap, model))
    assert len(got) == len(want) == 2 + len(params)
    for g, w in zip(got, want):  # logits, loss, every gradient
        if exact:  # a power of two: the same bits, through both layers' backward too
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        else:  # one rounding moved at the head, carried back through two layers: fp32's defaults
            torch.testing.assert_close(g, w)
