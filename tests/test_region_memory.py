"""objective="memory" at region scope: what a site holds for backward, with a controlled clock.

The written-out SiLU ``h * sigmoid(h)`` keeps ``sigmoid(h)`` for backward beside ``h``;
``F.silu(h)`` keeps only ``h``, the region's input. The bytes are exact, the times come from
the controlled clock (tests/controlled.py): the tests check decisions, never speed.
"""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule

import rewriter
from rewriter import Pass, PassContext, Site
from rewriter.capture.front_ends import finish_rewrite
from rewriter.capture.ir import annotate_tensor_info, copy_graph_module, mark_new_node
from rewriter.capture.record import Recorded
from rewriter.capture.region import find_regions
from rewriter.decide import memory
from rewriter.decide.site_gate import held_for_backward
from tests.controlled import QUICK, ControlledClock

D, ROWS, LAYERS = 32, 64, 3


class WrittenSilu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            x = h * torch.sigmoid(h)
        return x


class FusedSilu(WrittenSilu):
    def forward(self, x):
        for layer in self.layers:
            x = F.silu(layer(x))
        return x


class ToSilu(Pass):
    """``h * sigmoid(h)`` -> ``F.silu(h)``: holds ``sigmoid(h)`` no more."""

    name = "to_silu"

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        return [Site(n, n.name) for n in gm.graph.nodes
                if n.op == "call_function" and n.target in (operator.mul, torch.mul) and len(n.args) == 2
                and getattr(n.args[1], "target", None) is torch.sigmoid and n.args[1].args[0] is n.args[0]]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            mul = site.anchor
            sig = mul.args[1]
            with g.inserting_before(mul):
                new = g.call_function(F.silu, (mul.args[0],))
                mark_new_node(new, self.name, like=mul)
            mul.replace_all_uses_with(new)
            g.erase_node(mul)
            if not sig.users:
                g.erase_node(sig)


class FromSilu(Pass):
    """``F.silu(h)`` -> ``h * sigmoid(h)``: holds ``sigmoid(h)`` as well."""

    name = "from_silu"

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        return [Site(n, n.name) for n in gm.graph.nodes
                if n.op == "call_function" and n.target is F.silu]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            node = site.anchor
            with g.inserting_before(node):
                sig = g.call_function(torch.sigmoid, (node.args[0],))
                new = g.call_function(torch.mul, (node.args[0], sig))
                mark_new_node(sig, self.name, like=node)
                mark_new_node(new, self.name, like=node)
            node.replace_all_uses_with(new)
            g.erase_node(node)


def _optimize(model, pass_, costs, objective="memory", training=True, report=False, kb=False):
    torch.manual_seed(0)
    fast = rewriter.optimize(model.train(training), (torch.randn(ROWS, D),), passes=[pass_],
                             clock=ControlledClock(costs), gate=QUICK, objective=objective,
                             knowledge_base=kb, profile=False, progress=False, time_budget=None)
    d = next(d for d in fast.report.decisions if d.pass_name == pass_.name)
    return (d, fast.report) if report else d


def test_a_site_holds_exactly_the_bytes_autograd_saves_beyond_its_inputs():
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(WrittenSilu())
    annotate_tensor_info(gm, (torch.randn(ROWS, D),), {})
    cand, p = copy_graph_module(gm), ToSilu()
    p.apply(cand, p.find(cand, None), None)
    finish_rewrite(cand)
    regions = find_regions(gm, cand, p.find(copy_graph_module(gm), None), p.name, "graph_0")
    assert len(regions) == LAYERS
    h = torch.randn(ROWS, D, requires_grad=True)
    rng = torch.get_rng_state()
    before, after = held_for_backward(regions[0], [Recorded(h, True)])
    assert (before, after) == (ROWS * D * 4, 0)  # sigmoid(h) in fp32; h itself is the input
    assert h.grad is None and torch.equal(torch.get_rng_state(), rng)  # a forward, nothing more


def test_a_region_that_holds_less_is_kept_within_the_slowdown_bound_only_for_memory():
    d, report = _optimize(WrittenSilu(), ToSilu(), {"to_silu": 1.02}, report=True)
    row = d.regions[0]
    assert d.kept and d.objective == "memory"
    assert "saves memory" in row["reason"] and "(-100%)" in row["reason"]
    assert (row["held_bytes_before"], row["held_bytes_after"]) == (ROWS * D * 4, 0)
    held = LAYERS * ROWS * D * 4 / 2**20  # every site's, in the report's Memory section
    assert f"| to_silu | memory | {held:.2f} -> 0.00 held for backward |" in report.to_markdown()
    timed = _optimize(WrittenSilu(), ToSilu(), {"to_silu": 1.02}, objective="time")
    assert not timed.kept and timed.objective == "time" and "held_bytes_before" not in timed.regions[0]


def test_a_region_that_holds_less_but_is_too_slow_is_not_kept():
    d = _optimize(WrittenSilu(), ToSilu(), {"to_silu": 1.25})
    assert not d.kept and d.objective == "memory"
    assert "too slow for the memory objective" in d.regions[0]["reason"]


def test_a_faster_region_that_holds_more_is_not_kept_for_memory():
    assert _optimize(FusedSilu(), FromSilu(), {"from_silu": 0.7}, objective="time").kept
    d = _optimize(FusedSilu(), FromSilu(), {"from_silu": 0.7})
    assert not d.kept and d.objective == "memory"
    assert "holds more for backward" in d.regions[0]["reason"]


def test_in_inference_regions_are_decided_on_time_under_either_objective():
    d, report = _optimize(WrittenSilu(), ToSilu(), {"to_silu": 1.02}, training=False, report=True)
    assert not d.kept and d.objective == "time" and "held_bytes_before" not in d.regions[0]
    assert "memory" not in report.phases  # nothing held was measured


MB = 2**20


@pytest.mark.parametrize("speedup, before, after, floor, want", [
    (0.99, 4 * MB, 1 * MB, 0, (True, "memory")),       # holds less, within the 3% bound
    (0.90, 4 * MB, 1 * MB, 0, (False, "memory")),      # holds less, too slow
    (None, 4 * MB, 1 * MB, 0, (False, "time")),        # no usable time figure: time verdict
    (0.99, 4 * MB, 1 * MB, 10 * MB, (False, "time")),  # saves less than the floor over its sites
    (0.99, 100 * MB, 99.5 * MB, 0, (False, "time")),   # under 1% of what a site holds
    (1.30, 0, 64, 1024, (True, "time")),               # faster, holds a few bytes more: no matter
    (1.30, 1 * MB, 2 * MB, 0, (False, "memory")),      # faster, holds more: not kept
])
def test_the_memory_verdict_of_a_region(speedup, before, after, floor, want):
    keep = speedup is not None and speedup > 1.05  # the time verdict under min_speedup 1.05
    got = memory.decide_held(keep, "on time", speedup, before, after, 3, floor, 0.03)
    assert got[0::2] == want


def test_a_region_the_knowledge_base_rejects_on_time_is_still_judged_on_memory(tmp_path):
    kb = str(tmp_path / "kb.json")
    assert not _optimize(WrittenSilu(), ToSilu(), {"to_silu": 1.02}, objective="time", kb=kb).kept
    d = _optimize(WrittenSilu(), ToSilu(), {"to_silu": 1.02}, kb=kb)
    row = d.regions[0]
    assert d.kept and row["source"] == "knowledge base" and "saves memory" in row["reason"]
