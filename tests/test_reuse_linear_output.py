"""reuse_linear_output: a Linear with an output of 8 MiB or more writes into a kept buffer (CPU)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import passes.reuse_linear_output as rlo
from rewriter.devices.kept_buffers import KeptBuffers
from tests.helpers import code, outputs_and_grads, rewrite

# 2 x 128 tokens x 8193 outputs x 4 bytes: just above 8 MiB; 8191 just below
ABOVE, BELOW = rlo.FLOOR // (256 * 4) + 1, rlo.FLOOR // (256 * 4) - 1


class Head(nn.Module):
    def __init__(self, out: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, out, bias=bias)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


@pytest.fixture(autouse=True)
def _fresh_buffers():
    rlo.release_buffers()
    yield
    rlo.release_buffers()


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_large_linear_only_is_rewritten_and_outputs_and_grads_are_exact(front_end, bias):
    torch.manual_seed(0)
    model, x = Head(ABOVE, bias), torch.randn(2, 128, 32)
    cap, sites = rewrite(model, (x,), "reuse_linear_output", front_end=front_end, training=True)
    assert len(sites) == 1 and "8 MiB out" in sites[0].description  # the 32->32 projection is not a site
    assert "kept_linear" in code(cap)
    params = list(model.parameters())
    for got, want in zip(*[sum(outputs_and_grads(f, (x,), params), []) for f in (cap, model)]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same GEMMs


def test_below_the_floor_is_not_a_site():
    model, x = Head(BELOW), torch.randn(2, 128, 32)
    _, sites = rewrite(model, (x,), "reuse_linear_output", training=True)
    assert sites == []


def test_an_output_still_held_is_never_handed_out_again():
    torch.manual_seed(0)
    x, w = torch.randn(64, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    first = rlo.kept_linear(x, w)
    held = first.detach().clone()
    second = rlo.kept_linear(x, w)            # `first` alive: the second buffer
    assert second.data_ptr() != first.data_ptr()
    del second
    third = rlo.kept_linear(x * 2, w)         # the second buffer, free again
    torch.testing.assert_close(first, held, rtol=0, atol=0)  # the held output untouched
    view = third[:3]                          # a view holds the storage too
    del third
    fourth = rlo.kept_linear(x, w)
    assert fourth.data_ptr() != view.data_ptr()
    torch.testing.assert_close(view, (x * 2 @ w.t())[:3], rtol=0, atol=0)


def test_a_loop_that_keeps_last_steps_output_alternates_two_buffers():
    x, w = torch.randn(64, 16), torch.randn(40, 16)
    out, seen = None, []
    for _ in range(6):
        out = rlo.kept_linear(x, w)  # the previous `out` is alive during this call
        seen.append(out.data_ptr())
    assert len(set(seen)) == 2 and seen[0::2] == [seen[0]] * 3


def test_the_output_may_be_modified_in_place_under_autograd():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = rlo.kept_linear(x, w)
    y.mul_(2)  # not a view of the kept buffer: autograd allows it
    y.sum().backward()
    torch.testing.assert_close(w.grad, 2 * torch.ones(40, 8) @ x.detach(), rtol=1e-6, atol=1e-6)


def test_a_graph_pending_backward_keeps_its_input_not_the_output():
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    loss = rlo.kept_linear(x, w).square().sum()   # square saves the output: it stays held
    other = rlo.kept_linear(x, w)
    loss.backward()                                # still correct after another call
    want = torch.autograd.grad((x @ w.t()).square().sum(), w)[0]
    torch.testing.assert_close(w.grad, want, rtol=1e-5, atol=1e-5)
    assert other.shape == (8, 40)


def test_outside_the_cpu_or_under_compile_it_is_f_linear(monkeypatch):
    x, w = torch.randn(8, 16), torch.randn(40, 16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    y = rlo.kept_linear(x, w)
    assert rlo._OUTPUTS.buffers == {}  # nothing kept
    torch.testing.assert_close(y, F.linear(x, w), rtol=0, atol=0)


def test_a_graph_handed_to_aot_autograd_traces_it_as_f_linear():
    """The regional compile hands its graphs to the backend directly: AOTAutograd traces them
    with fake tensors, not under Dynamo (torch.compiler.is_compiling() is False there)."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    loss = aot_function(lambda x, w: rlo.kept_linear(x, w).square().sum(), compiler)(x, w)
    loss.backward()
    assert rlo._OUTPUTS.buffers == {}  # nothing kept: the compiler plans its buffers
    torch.testing.assert_close(w.grad, 2 * (x @ w.t()).t().detach() @ x.detach(), rtol=1e-5, atol=1e-4)
    assert graphs and any("mm" in str(n.target) for n in graphs[0].graph.nodes)


def test_kept_buffers_validate_and_replace_the_oldest():
    with pytest.raises(ValueError, match="slots"):
        KeptBuffers(slots=0)
    pool = KeptBuffers(slots=2)
    a = pool.take((4, 4), torch.float32, torch.device("cpu"))
    b = pool.take((4, 4), torch.float32, torch.device("cpu"))
    c = pool.take((4, 4), torch.float32, torch.device("cpu"))  # both held: a third, the oldest dropped
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert len(pool.buffers[(torch.float32, torch.device("cpu"))]) == 2
    big = pool.take((4, 9), torch.float32, torch.device("cpu"))  # over twice the size: not reused
    assert big.shape == (4, 9) and big._base is None


def test_optimize_keeps_it_under_a_faster_clock_and_the_offline_script_writes_it(tmp_path, monkeypatch):
    import rewriter
    from rewriter.capture import graph_export
    from rewriter.decide import regions
    from tests.controlled import QUICK, ControlledClock

    monkeypatch.setattr(regions, "step_maps_fresh_pages", lambda run, tries: True)  # a trimmed heap

    torch.manual_seed(0)
    model, x = Head(ABOVE).eval(), torch.randn(2, 128, 32)
    fast = rewriter.optimize(model, (x,), passes=["reuse_linear_output"], front_end="fx",
                             clock=ControlledClock({"reuse_linear_output": 0.5}), gate=QUICK,
                             progress=False, profile=False, knowledge_base=False, compile=False)
    assert [(d.pass_name, d.status) for d in fast.report.decisions] == [("reuse_linear_output", "kept")]
    export = graph_export.write_graph_code(fast, tmp_path)
    assert "kept_linear" in (tmp_path / graph_export.MODULE_FILE).read_text()
    rewritten = graph_export.load_exported(export.loadable).load(model)
    torch.testing.assert_close(rewritten(x), model(x), rtol=0, atol=0)


def test_where_the_step_maps_no_fresh_pages_it_is_not_tried(monkeypatch):
    """It saves only the pages a step maps afresh: where the step maps few, nothing is measured."""
    import rewriter
    from rewriter.decide import regions
    from tests.controlled import QUICK, ControlledClock

    counted = []
    monkeypatch.setattr(regions, "step_maps_fresh_pages", lambda run, tries: counted.append(tries) or False)
    measured = []
    monkeypatch.setattr(regions, "measure_region", lambda *a, **k: measured.append(1))
    model, x = Head(ABOVE).eval(), torch.randn(2, 128, 32)
    fast = rewriter.optimize(model, (x,), passes=["reuse_linear_output"], front_end="fx",
                             clock=ControlledClock({"reuse_linear_output": 0.5}), gate=QUICK,
                             progress=False, profile=False, knowledge_base=False, compile=False)
    (d,) = fast.report.decisions
    assert (d.pass_name, d.status) == ("reuse_linear_output", "not applicable")
    assert "maps fewer than 5000" in d.reason and counted == [3] and measured == []
