"""The rule layer's matcher (rewriter/rules.py): each spelling of one op, commutation and
association, each optional link, constants with a tolerance and as 0-d tensors, and the
"no outside users" rule. Graphs are traced from small functions and annotated with real
tensor facts, as captures are."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from rewriter.capture.ir import annotate_tensor_info
from rewriter.rules import Pattern, Rule, canonical, is_optional_link


def _graph(fn, *args):
    gm = torch.fx.symbolic_trace(fn)
    annotate_tensor_info(gm, args, {})
    return gm


def _root(gm):
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


def _rule(pattern, requires=()):
    return Rule("test", pattern, lambda g, m, ctx: None, requires)


def _matches(pattern, fn, *args):
    return _rule(pattern).match(_root(_graph(fn, *args)))


def scale_pattern(x):
    return x * 0.5


def square_mean_pattern(x):
    return torch.pow(x, 2).mean(-1, keepdim=True)


def norm_pattern(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def gelu_pattern(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


X = torch.randn(3, 8)


# --- spellings -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda x: x * 0.5, lambda x: torch.mul(x, 0.5), lambda x: x.mul(0.5), lambda x: 0.5 * x,
    lambda x: x / 2.0, lambda x: torch.div(x, 2), lambda x: x.div(2.0),
], ids=["operator", "function", "method", "reflected", "div-operator", "div-function", "div-method"])
def test_one_op_in_every_spelling(fn):
    m = _matches(scale_pattern, fn, X)
    assert m is not None and m["x"].op == "placeholder"


@pytest.mark.parametrize("fn", [
    lambda x: torch.pow(x, 2).mean(-1, keepdim=True), lambda x: (x ** 2).mean(-1, keepdim=True),
    lambda x: x.pow(2.0).mean(dim=-1, keepdim=True), lambda x: (x * x).mean(1, True),
    lambda x: torch.square(x).mean([-1], keepdim=True), lambda x: torch.mean(x.pow(2), dim=(1,), keepdim=True),
], ids=["pow", "operator-pow", "method-kwargs", "x*x-positive-dim", "square-list-dim", "function-tuple-dim"])
def test_square_and_reduction_spellings(fn):
    assert _matches(square_mean_pattern, fn, X) is not None


@pytest.mark.parametrize("fn", [
    lambda x: x.pow(2).mean(0, keepdim=True),       # another dim
    lambda x: x.pow(2).mean(-1),                    # keepdim missing: its default False
    lambda x: x.pow(3).mean(-1, keepdim=True),      # another exponent
    lambda x: (x * (x + 0)).mean(-1, keepdim=True),  # x * y: not a square
], ids=["dim", "keepdim", "exponent", "x*y"])
def test_wrong_arguments_do_not_match(fn):
    assert _matches(square_mean_pattern, fn, X) is None


def test_aten_overloads_match():
    gm = make_fx(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))(X)
    root = _root(gm)
    assert str(root.target).startswith("aten.mul") and canonical(root) == "mul"
    m = _rule(norm_pattern).match(root)
    assert m is not None and m.number("eps") == pytest.approx(1e-6)


def test_in_place_division_is_division_only_when_nothing_else_reads_the_tensor():
    def build(extra_reader):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(operator.mul, (x, 1.0))
        out = g.call_function(operator.itruediv, (y, 2.0))  # y /= 2.0
        outs = (out, g.call_function(operator.add, (y, 1.0))) if extra_reader else out
        g.output(outs)
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        annotate_tensor_info(gm, (X,), {})
        return gm, out

    def half_of_mul_pattern(x):
        return x * 1.0 / 2.0

    gm, out = build(False)
    assert canonical(out) == "div" and _rule(half_of_mul_pattern).match(out) is not None
    gm, out = build(True)  # y is read after it was divided in place: not a pure division
    assert _rule(half_of_mul_pattern).match(out) is None


# --- commutation and association ---------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda x: 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3))),
    lambda x: x * 0.5 * (torch.tanh((0.044715 * x ** 3 + x) * 0.7978845608) + 1),
    lambda x: (0.5 * (x * (1 + torch.tanh(0.7978845608 * (x + x.pow(3) * 0.044715))))),
    lambda x: x / 2 * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3)))),
], ids=["as-written", "commuted", "re-associated", "halved-by-division"])
def test_products_and_sums_in_any_order(fn):
    assert _matches(gelu_pattern, fn, X) is not None


def test_non_commutative_ops_keep_their_order():
    def sub_pattern(x, y):
        return x - y
    m = _matches(sub_pattern, lambda a: a - 1.0, X)
    assert m is not None and m["y"] == 1.0
    m = _matches(sub_pattern, lambda a: 1.0 - a, X)
    assert m["x"] == 1.0  # bound in order: x - y, never y - x


# --- constants ---------------------------------------------------------------------------------

@pytest.mark.parametrize("c, fires", [(0.5, True), (0.5 * (1 + 5e-7), True), (0.5 * (1 + 5e-6), False), (0.4, False)])
def test_constant_tolerance(c, fires):
    assert (_matches(scale_pattern, lambda x: x * c, X) is not None) is fires


@pytest.mark.parametrize("make", [lambda: torch.full((), 0.5), lambda: torch.tensor(0.5)],
                         ids=["full", "tensor"])
def test_constants_as_zero_d_tensors(make):
    assert _matches(scale_pattern, lambda x: x * make(), X) is not None


def test_constant_as_a_zero_d_buffer():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.tensor(0.5))

        def forward(self, x):
            return x * self.s
    gm = torch.fx.symbolic_trace(Scaled())
    annotate_tensor_info(gm, (X,), {})
    assert _rule(scale_pattern).match(_root(gm)) is not None


# --- optional links ------------------------------------------------------------------------------

@pytest.mark.parametrize("link", [
    lambda t: t.contiguous(), lambda t: t.clone(), lambda t: t.to(torch.float32), lambda t: t.float(),
    lambda t: F.dropout(t, 0.0), lambda t: F.dropout(t, 0.5, training=False), lambda t: t.view(3, 8),
    lambda t: t.reshape(3, 8), lambda t: t.type_as(t),
], ids=["contiguous", "clone", "no-op to", "no-op float", "dropout p=0", "dropout eval", "view", "reshape",
        "type_as"])
def test_optional_links_are_looked_through(link):
    m = _matches(norm_pattern, lambda x: x * torch.rsqrt(link(x.pow(2)).mean(-1, keepdim=True) + 1e-5), X)
    assert m is not None and len(m.links) == 1


def test_an_up_cast_is_a_link_and_a_down_cast_is_not():
    half = X.to(torch.bfloat16)
    up = _matches(norm_pattern, lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6), half)
    assert up is not None and up["x"].op == "placeholder"  # T5: squares an fp32 copy, scales x
    down = _matches(norm_pattern, lambda x: x * torch.rsqrt(x.to(torch.bfloat16).pow(2).mean(-1, keepdim=True)
                                                             + 1e-6), X)
    assert down is None


@pytest.mark.parametrize("link", [lambda t: F.dropout(t, 0.1), lambda t: t.view(8, 3), lambda t: t.t()],
                         ids=["dropout", "reshaping view", "transpose"])
def test_links_that_change_values_or_order_are_not_optional(link):
    gm = _graph(lambda x: link(x) + 1, X)
    node = next(n for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
    assert not is_optional_link(node)


# --- outside users -------------------------------------------------------------------------------

def test_an_internal_node_read_outside_the_match_rejects_it():
    def reused(x):
        v = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(v + 1e-6), v
    gm = _graph(reused, X)
    mul = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.mul)
    assert _rule(norm_pattern).match(mul) is None


def test_a_wildcard_seen_twice_must_be_one_value():
    def two_inputs(x, y):
        return x * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert _matches(norm_pattern, two_inputs, X, X.clone()) is None


def test_requires_filters_matches():
    never = _rule(norm_pattern, requires=(lambda m: False,))
    fn = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    assert never.match(_root(_graph(fn, X))) is None


def test_a_pattern_that_computes_nothing_is_a_clear_error():
    with pytest.raises(ValueError, match="must compute something"):
        Pattern(lambda x: x)


# --- the pass driver ----------------------------------------------------------------------------

def test_rule_pass_reports_matches_inside_an_autograd_function():
    from rewriter.devices.backends import CpuBackend
    from rewriter.pass_api import PassContext, registered_passes

    class Gelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * torch.sigmoid(1.702 * x)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(4, 8, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(lambda t: Gelu.apply(t) * 2, backend=backend)(x)
    gm = graphs[0]
    assert any("autograd_function_apply" in str(n.target) for n in gm.graph.nodes)
    ctx = PassContext(CpuBackend(), True)
    assert registered_passes()["fuse_gelu"].find(gm, ctx) == []
    assert any("inside an autograd.Function" in d for d in ctx.declined)
