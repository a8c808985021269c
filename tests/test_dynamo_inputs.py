"""A graph compiled outside Dynamo gets what Dynamo would hand the backend, so Inductor's and
AOTAutograd's caches keep it (rewriter.devices.dynamo_inputs)."""
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from rewriter.devices.dynamo_inputs import as_dynamo_hands_it


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x))) * scale


def _graph() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(Mlp())


def test_the_backend_gets_static_fakes_of_a_fake_mode_with_a_shape_env_in_a_tracing_context():
    seen = {}

    def backend(gm, example_inputs):
        ctx = TracingContext.try_get()
        seen.update(ctx=ctx, inputs=list(example_inputs))
        return gm

    gm = _graph()
    x = torch.randn(4, 8).t().contiguous().t()  # strided: the fake keeps the strides
    compiled = as_dynamo_hands_it(backend)(gm, [x, 0.5])
    fake, scale = seen["inputs"]
    assert seen["ctx"] is not None and seen["ctx"].fake_mode.shape_env is not None
    assert isinstance(fake, FakeTensor) and fake.fake_mode is seen["ctx"].fake_mode
    assert (fake.shape, fake.stride(), fake.dtype) == (x.shape, x.stride(), x.dtype)
    assert not any(isinstance(s, torch.SymInt) for s in fake.shape)  # static: the example's sizes
    assert scale == 0.5 and TracingContext.try_get() is None  # the context ends with the compile
    torch.testing.assert_close(compiled(x, 0.5), gm(x, 0.5))


def test_inside_a_trace_the_inputs_go_through_as_they_came():
    seen = []
    compile_graph = as_dynamo_hands_it(lambda gm, example_inputs: seen.append(example_inputs) or gm)
    x = torch.randn(4, 8)
    outer = TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with tracing(outer):
        compile_graph(_graph(), [x, 1.0])
    assert seen[0][0] is x
    fake = FakeTensorMode().from_tensor(x)
    compile_graph(_graph(), [fake, 1.0])
    assert seen[1][0] is fake


def test_a_second_compile_of_the_same_graph_is_served_by_both_caches(tmp_path, monkeypatch):
    # A new, empty cache folder: the first compile stores, the second (new objects, the same
    # graph and inputs) loads both its FX graph and its AOTAutograd entry.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compile_graph = as_dynamo_hands_it(torch._dynamo.lookup_backend("inductor"))
    x = torch.randn(4, 8)

    def train(gm):
        compiled = compile_graph(gm, [x, 0.5])
        out = compiled(x, 0.5)
        out.sum().backward()
        return out, gm.up.weight.grad

    before = {k: dict(v) for k, v in counters.items()}
    ref_gm = _graph()
    ref_out = ref_gm(x, 0.5)
    ref_out.sum().backward()
    for _ in range(2):
        out, grad = train(_graph())
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)  # 8- and 16-long sums, fp32
        torch.testing.assert_close(grad, ref_gm.up.weight.grad, rtol=1e-5, atol=1e-6)

    def grew(group, key):
        return counters[group][key] - before.get(group, {}).get(key, 0)
    assert grew("aot_autograd", "autograd_cache_miss") == 1 and grew("aot_autograd", "autograd_cache_hit") == 1
    assert grew("aot_autograd", "autograd_cache_bypass") == 0
    assert grew("inductor", "fxgraph_cache_bypass") == 0 and grew("inductor", "fxgraph_cache_hit") >= 1
