"""The cross-entropy handed to a compiler (rewriter.devices.compiled_loss) and the cut after
returned logits (rewriter.devices.loss_cut): the same loss and gradients as F.cross_entropy
and the uncut graph, the rewrite only where it qualifies, the cut only where it is safe, and
AOTAutograd's cache accepting a graph that holds the form."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rewriter.devices.compiled_loss import (CACHEABLE, compiled_cross_entropy, rewrite_losses,
                                            with_compiled_losses)
from rewriter.devices.executors import cacheable_with_losses
from rewriter.devices.loss_cut import _cut
from tests.test_nested_blocks import Recorder


def _grads(fn, logits, target, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x.float() if x.dtype != torch.float32 else x, target, **kw)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_form_gives_cross_entropys_loss_and_gradient(dtype, reduction):
    torch.manual_seed(0)
    logits = torch.randn(64, 300).to(dtype)
    target = torch.randint(0, 300, (64,))
    target[::5] = -100
    want_loss, want_grad = _grads(F.cross_entropy, logits, target, reduction=reduction)
    x = logits.clone().requires_grad_()
    loss = compiled_cross_entropy(x, target, -100, reduction)  # half logits upcast inside
    loss.backward()
    assert x.grad.dtype == dtype
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    # fp32: rounding of the same math; half: the fp32 gradient rounded once (one ulp apart)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(x.grad, want_grad, **tol)


def test_an_all_ignored_mean_batch_gives_nan_and_zero_gradients_as_cross_entropy_does():
    logits = torch.randn(4, 10, requires_grad=True)
    target = torch.full((4,), -100)
    assert torch.isnan(F.cross_entropy(logits, target))
    loss = compiled_cross_entropy(logits, target)
    loss.backward()
    assert torch.isnan(loss) and torch.equal(logits.grad, torch.zeros_like(logits))


def test_the_form_compiled_by_inductor_matches_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(32, 100)
    target = torch.randint(0, 100, (32,))
    target[3] = -100
    want_loss, want_grad = _grads(F.cross_entropy, logits, target)
    got_loss, got_grad = _grads(torch.compile(compiled_cross_entropy, backend="inductor"), logits, target)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


class LM(nn.Module):
    """Logits (half under the caller's autocast) upcast, flattened, and their loss; returns both."""

    def __init__(self, smoothing: float = 0.0) -> None:
        super().__init__()
        self.head, self.smoothing = nn.Linear(8, 50), smoothing

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(h)
        loss = F.cross_entropy(logits.float().view(-1, 50), labels.view(-1), label_smoothing=self.smoothing)
        return logits, loss


def _graph_of(model, *args):
    rec = Recorder()
    torch.compile(model, backend=rec)(*args)
    torch._dynamo.reset()
    return rec.graphs[0]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_the_rewrite_replaces_a_qualifying_loss_and_drops_its_upcast():
    h, labels = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
    gm = _graph_of(LM(), h, labels)
    assert F.cross_entropy in _targets(gm) and "float" in _targets(gm)
    assert rewrite_losses(gm) == 1
    assert compiled_cross_entropy in _targets(gm)
    assert F.cross_entropy not in _targets(gm) and "float" not in _targets(gm)


def test_the_rewrite_leaves_a_loss_that_does_not_qualify():
    h, labels = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
    gm = _graph_of(LM(smoothing=0.1), h, labels)
    assert rewrite_losses(gm) == 0
    assert F.cross_entropy in _targets(gm)


def test_a_model_compiled_with_the_forms_gives_the_eager_loss_and_gradients():
    torch.manual_seed(0)
    h, labels = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
    labels[0, 0] = -100
    eager, model = LM(), LM()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend=with_compiled_losses(torch._dynamo.lookup_backend("aot_eager")))
    try:
        for m in (eager, compiled):
            logits, loss = m(h, labels)
            (loss + logits.square().mean()).backward()  # the logits differentiated too: the sum
    finally:
        torch._dynamo.reset()
    for a, b in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)


def _cut_graph(model, *args):
    gm = _graph_of(model, *args)
    with torch.enable_grad():
        return _cut(gm)


def test_the_cut_puts_the_loss_in_a_second_part_reading_the_returned_logits():
    h, labels = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
    first, second, plan = _cut_graph(LM(), h, labels)
    assert F.cross_entropy in _targets(second) and F.cross_entropy not in _targets(first)
    assert plan["outputs"] == [("first", 0), ("second", 0)]
    assert ("first", 0) in plan["reads"]  # the loss reads the returned logits, not a second copy
    out = next(n for n in first.graph.nodes if n.op == "output")
    differentiable = [n for n in out.args[0] if n.meta["example_value"].requires_grad]
    assert len(differentiable) == 1  # the logits once: no second output to get a zero gradient


def test_the_cut_declines_without_grad_and_where_the_second_part_draws_or_writes():
    h, labels = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
    gm = _graph_of(LM(), h, labels)
    with torch.no_grad():
        assert _cut(gm) is None

    class Noisy(LM):
        def forward(self, h, labels):
            logits = self.head(h)
            return logits, F.dropout(logits, 0.5).sum()

    class InPlace(LM):
        def forward(self, h, labels):
            logits = self.head(h)
            return logits, logits.clone().mul_(2).sum()

    for model in (Noisy(), InPlace()):
        assert _cut_graph(model, h, labels) is None


def test_the_cut_declines_a_graph_of_symbolic_sizes():
    rec = Recorder()
    compiled = torch.compile(LM(), backend=rec, dynamic=True)
    compiled(torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6)))
    torch._dynamo.reset()
    with torch.enable_grad():
        assert _cut(rec.graphs[0]) is None


def test_aotautograds_cache_accepts_the_form_only_as_marked_cacheable():
    from torch._functorch._aot_autograd.autograd_cache import (BypassAOTAutogradCache,
                                                              check_node_safe)
    gm = _graph_of(LM(), torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6)))
    rewrite_losses(gm)
    node = next(n for n in gm.graph.nodes if n.target is compiled_cross_entropy)
    with pytest.raises(BypassAOTAutogradCache):
        check_node_safe(node)
    assert set(CACHEABLE) <= set(cacheable_with_losses())
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions=cacheable_with_losses()):
        check_node_safe(node)  # raises if the name is not the one AOTAutograd reads


def test_half_logits_qualify_only_under_cpu_autocast_of_their_dtype():
    """Under CPU autocast F.cross_entropy of bf16 logits computes in fp32 (the form's math);
    outside it, in bf16: left as it is."""
    class Half(nn.Module):
        def forward(self, logits, labels):
            return F.cross_entropy(logits.view(-1, 50), labels.view(-1))

    args = torch.randn(2, 6, 50).to(torch.bfloat16), torch.randint(0, 50, (2, 6))
    assert rewrite_losses(_graph_of(Half(), *args)) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = _graph_of(Half(), *args)
        assert rewrite_losses(gm) == 1


def test_with_compiled_losses_cuts_only_where_the_part_after_the_cut_holds_a_loss():
    class Head(nn.Module):  # returns its hidden states and the logits made of them: no loss
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 50)

        def forward(self, h):
            hidden = self.body(h)
            return hidden, self.head(hidden)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    h, labels = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
    try:
        torch.compile(Head(), backend=with_compiled_losses(backend))(h)
        assert len(graphs) == 1  # whole
        torch._dynamo.reset()
        graphs.clear()
        torch.compile(LM(), backend=with_compiled_losses(backend))(h, labels)
        assert len(graphs) == 2  # cut: the model's part, then the loss's at its first call
        assert compiled_cross_entropy not in _targets(graphs[0]) and compiled_cross_entropy in _targets(graphs[1])
    finally:
        torch._dynamo.reset()
