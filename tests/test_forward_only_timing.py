"""A pass whose replacement keeps the original's backward (``Pass.same_backward``:
reuse_linear_output) has its training regions timed forward only, and still verified forward
and backward; a long region's comparison takes one warm-up round after each form's first call.
Controlled clocks: what is checked is what runs, not what it costs."""
from __future__ import annotations

import types

import pytest
import torch

import rewriter
from rewriter.capture.record import Recorded
from rewriter.decide import regions, site_gate
from rewriter.capture.ir import mark_new_node
from tests.controlled import QUICK, ControlledClock, RewriteRelu
from tests.models import Blocks

BACKWARDS: list[int] = []


class _CountedRelu(torch.autograd.Function):
    """relu, its backward counted (BACKWARDS) and scaled by ``scale`` (2: a wrong gradient)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.relu()

    @staticmethod
    def backward(ctx, grad):
        BACKWARDS.append(1)
        (x,) = ctx.saved_tensors
        return grad * (x > 0) * ctx.scale, None


def counted_relu(x):
    return _CountedRelu.apply(x, 1.0)


def wrong_grad_relu(x):
    return _CountedRelu.apply(x, 2.0)


torch.fx.wrap("counted_relu")  # a call in a traced region, not traced through


class SameBackwardRelu(RewriteRelu):
    """Replaces each relu by ``counted_relu`` (or ``wrong_grad_relu``), saying its backward
    is the original's."""

    same_backward = True

    def __init__(self, name: str, wrong_grad: bool = False):
        super().__init__(name)
        self.replacement = wrong_grad_relu if wrong_grad else counted_relu

    def apply(self, gm, sites, ctx):
        g = gm.graph
        for site in sites:
            with g.inserting_after(site.anchor):
                new = g.call_function(self.replacement, site.anchor.args)
                mark_new_node(new, self.name, like=site.anchor)
            site.anchor.replace_all_uses_with(new)
            g.erase_node(site.anchor)


def _region_form():
    return torch.fx.symbolic_trace(lambda x: (counted_relu(x) * 3,))


@pytest.mark.parametrize("forward_only, backwards", [(True, False), (False, True)])
def test_a_training_region_is_timed_without_its_backward_only_when_asked(forward_only, backwards):
    gm = _region_form()
    BACKWARDS.clear()
    m = site_gate.measure_region(types.SimpleNamespace(pass_name="a"),
                                 [Recorded(torch.randn(4, 32), requires_grad=True)], True,
                                 clock=ControlledClock({"a": 0.5}), settings=QUICK, min_speedup=1.05,
                                 forms=(gm, gm), forward_only=forward_only)
    assert m.pairs > 0
    assert bool(BACKWARDS) is backwards


def test_a_forward_only_comparison_times_the_forward_again_for_its_sample_length(monkeypatch):
    """The original's seconds the caller passes are a forward and backward's: with
    ``forward_only`` the forward is timed anew (its repeats and fewest pairs follow from it)."""
    timed = []
    real = site_gate.one_call_ms
    monkeypatch.setattr(site_gate, "one_call_ms", lambda run, clock: timed.append(1) or real(run, clock))
    gm = _region_form()
    for forward_only in (False, True):
        site_gate.measure_region(types.SimpleNamespace(pass_name="a"),
                                 [Recorded(torch.randn(4, 32), requires_grad=True)], True,
                                 clock=ControlledClock({"a": 0.5}), settings=QUICK, min_speedup=1.05,
                                 forms=(gm, gm), original_seconds=0.2, forward_only=forward_only)
    assert timed == [1]  # the forward-only one


def test_a_long_region_takes_one_warm_up_round_after_each_forms_first_call():
    gm = torch.fx.symbolic_trace(lambda x: (x.relu(),))
    runs = {"n": 0}

    def counted(*args):
        runs["n"] += 1
        return gm(*args)
    settings = site_gate.GateSettings(min_pairs=4, max_pairs=4, region_min_pairs=4, region_max_pairs=4,
                                      region_warmup_seconds=0.0)  # rounds, not seconds: counted
    site_gate.measure_region(types.SimpleNamespace(pass_name="a"), [Recorded(torch.randn(4, 8))], False,
                             clock=ControlledClock({"a": 0.5}), settings=settings, min_speedup=1.05,
                             forms=(counted, counted), original_seconds=site_gate.ONE_CALL_IS_ENOUGH_S)
    # per form: its first call, one warm-up round, 4 timed samples (repeats of 1: a long call)
    assert runs["n"] == 2 * (1 + 1 + 4)


def test_least_measuring_seconds_of_a_forward_only_comparison_is_its_forwards():
    g = site_gate.GateSettings()
    whole = site_gate.least_measuring_seconds(0.3, g, 0.35)
    forward = site_gate.least_measuring_seconds(0.3, g, 0.35, forward_only=True)
    assert forward == pytest.approx(site_gate.least_measuring_seconds(0.3 * site_gate.FORWARD_SHARE, g, 0.35))
    assert forward < whole


def _train(passes, clock, seen=None, monkeypatch=None, **kw):
    if seen is not None:
        real = regions.measure_region
        monkeypatch.setattr(regions, "measure_region",
                            lambda *a, **k: seen.append(k["forward_only"]) or real(*a, **k))
    torch.manual_seed(0)
    model = Blocks(n=2).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("knowledge_base", False)
    fast, _ = rewriter.optimize(model, (torch.randn(8, 16),), optimizer=opt, passes=passes, clock=clock,
                                gate=QUICK, loss_fn=lambda out: out.pow(2).mean(), profile=False,
                                progress=False, compile=False, **kw)
    return fast


def _row(fast, name):
    return next(d for d in fast.report.decisions if d.pass_name == name)


def test_in_training_such_a_pass_is_timed_forward_only_and_says_so(monkeypatch):
    seen = []
    BACKWARDS.clear()
    fast = _train([SameBackwardRelu("a")], ControlledClock({"a": 0.5}), seen, monkeypatch)
    d = _row(fast, "a")
    assert d.kept and "forward only" in d.reason, d.reason
    assert seen and all(seen)
    assert BACKWARDS  # the verification ran its backward


def test_a_pass_that_does_not_say_so_is_timed_forward_and_backward(monkeypatch):
    seen = []
    fast = _train([RewriteRelu("a")], ControlledClock({"a": 0.5}), seen, monkeypatch)
    d = _row(fast, "a")
    assert d.kept and "forward only" not in d.reason
    assert seen and not any(seen)


def test_its_backward_is_still_verified():
    """``same_backward`` is what the pass says, not what is trusted: a replacement whose
    gradient differs is rejected by the verification, and nothing of it is kept."""
    fast = _train([SameBackwardRelu("a", wrong_grad=True)], ControlledClock({"a": 0.5}))
    d = _row(fast, "a")
    assert not d.kept and "verif" in (d.status + d.reason).lower(), (d.status, d.reason)


def test_figures_timed_forward_only_are_kept_apart_in_the_knowledge_base(tmp_path, monkeypatch):
    """A signature timed forward and backward (before the pass said so) is measured again,
    not replayed, once the pass times it forward only."""
    kb = tmp_path / "kb.json"
    seen = []
    monkeypatch.setattr(SameBackwardRelu, "same_backward", False)
    _train([SameBackwardRelu("a")], ControlledClock({"a": 2.0}), knowledge_base=str(kb))  # rejected
    monkeypatch.setattr(SameBackwardRelu, "same_backward", True)
    fast = _train([SameBackwardRelu("a")], ControlledClock({"a": 0.5}), seen, monkeypatch,
                  knowledge_base=str(kb))
    assert seen == [True] and _row(fast, "a").kept
