"""The order passes are measured in: hottest first, never past one they compose with."""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule

import rewriter
from rewriter import Pass, PassContext, Site
from rewriter.capture.ir import annotate_tensor_info, mark_new_node
from rewriter.decide.hot_first import hot_first, region_bytes
from tests.controlled import QUICK, ControlledClock


def test_the_largest_potential_goes_first():
    assert hot_first(["a", "b", "c"], {"a": 1.0, "b": 5.0, "c": 3.0},
                     {"a": {1}, "b": {2}, "c": {3}}) == ["b", "c", "a"]


def test_equals_keep_the_registered_order():
    assert hot_first(["a", "b", "c"], {"a": 2.0, "b": 2.0, "c": 2.0},
                     {"a": {1}, "b": {2}, "c": {3}}) == ["a", "b", "c"]


def test_a_pass_never_overtakes_one_it_shares_a_node_with():
    # c is hottest but reads what a rewrites: a first, then c; b is free and cooler than c
    assert hot_first(["a", "b", "c"], {"a": 1.0, "b": 2.0, "c": 9.0},
                     {"a": {"x"}, "b": {"y"}, "c": {"x", "z"}}) == ["b", "a", "c"]


def test_an_unknown_reach_is_overtaken_by_nothing_and_overtakes_nothing():
    assert hot_first(["a", "s", "c"], {"a": 1.0, "s": None, "c": 9.0},
                     {"a": {1}, "s": set(), "c": {3}}) == ["a", "s", "c"]


def test_region_bytes_count_every_call_input_and_output():
    class Two(nn.Module):
        def forward(self, x):
            return torch.relu(x) + x

    gm = torch.fx.symbolic_trace(Two())
    annotate_tensor_info(gm, (torch.randn(4, 8),), {})
    # relu reads x, writes y; add reads y and x, writes z: five 4x8 fp32 tensors
    assert region_bytes(gm) == 5 * 4 * 8 * 4


CALLED: list[str] = []


def _marking(name, fn):
    def replacement(*args, **kwargs):
        CALLED.append(name)
        return fn(*args, **kwargs)
    replacement.__name__ = f"{name}_replacement"
    return replacement


class Replace(Pass):
    """Replaces each call of ``target`` by the same function, so each pass's regions are
    exactly the calls it matches."""

    contract = "exact"

    def __init__(self, name, target):
        self.name, self.target = name, target
        self.fn = _marking(name, target)

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        return [Site(n, n.name) for n in gm.graph.nodes
                if n.op == "call_function" and n.target is self.target]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        for site in sites:
            with gm.graph.inserting_after(site.anchor):
                new = gm.graph.call_function(self.fn, site.anchor.args, site.anchor.kwargs)
                mark_new_node(new, self.name, like=site.anchor)
            site.anchor.replace_all_uses_with(new)
            gm.graph.erase_node(site.anchor)


class SmallThenLarge(nn.Module):
    """A tanh on a few numbers, then a softmax on many (each in its own branch)."""

    def forward(self, small, large):
        return torch.tanh(small).sum() + F.softmax(large, dim=-1).sum()


class OriginalsOnTheWall(ControlledClock):
    """The decisions from controlled costs; an original region's own time (what a pass can act
    on: the scan's figure) from the wall clock, as the sizes below differ ~10 000-fold."""

    def time(self, step):
        if step.label != "original region, one call":
            return super().time(step)
        t0 = time.perf_counter()
        step.run()
        return time.perf_counter() - t0


def test_optimize_measures_the_hottest_pass_first_and_reports_in_the_registered_order():
    small, large = torch.randn(4, 4), torch.randn(512, 2048)
    clock = OriginalsOnTheWall({"cool": 0.5, "hot": 0.5})
    # negligible=0: the tanh's few microseconds (on the wall clock) are not judged against the
    # step; both regions are compared, from the controlled costs
    fast = rewriter.optimize(SmallThenLarge(), (small, large),
                             passes=[Replace("cool", torch.tanh), Replace("hot", F.softmax)],
                             clock=clock, gate=dataclasses.replace(QUICK, negligible=0.0),
                             profile=False, progress=False, knowledge_base=False)
    assert [d.pass_name for d in fast.report.decisions][:2] == ["cool", "hot"]
    assert all(d.kept for d in fast.report.decisions[:2])
    measured = [s[0] for s in clock.seen if len(s) == 1 and s[0] in ("cool", "hot")]
    assert measured[0] == "hot" and "cool" in measured


def test_a_pass_that_can_save_only_a_share_of_its_regions_is_weighed_by_that_share():
    # the softmax's region is ~10 000 times the tanh's, but its pass can save at most 1e-6 of it
    small, large = torch.randn(4, 4), torch.randn(512, 2048)
    clock = OriginalsOnTheWall({"cool": 0.5, "hot": 0.5})
    hot = Replace("hot", F.softmax)
    hot.saves_at_most = 1e-6  # an instance attribute over the class's 1.0
    rewriter.optimize(SmallThenLarge(), (small, large), passes=[Replace("cool", torch.tanh), hot],
                      clock=clock, gate=dataclasses.replace(QUICK, negligible=0.0),
                      profile=False, progress=False, knowledge_base=False)
    measured = [s[0] for s in clock.seen if len(s) == 1 and s[0] in ("cool", "hot")]
    assert measured[0] == "cool" and "hot" in measured


class ReplaceAndRetouch(Replace):
    """Replace, and also replaces each call of ``also``, which no site accounts for: its change
    is not local, so it is measured on the whole step."""

    def __init__(self, name, target, also):
        super().__init__(name, target)
        self.also, self.also_fn = also, _marking(f"{name}_also", also)

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        super().apply(gm, sites, ctx)
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is self.also:
                with gm.graph.inserting_after(n):
                    new = gm.graph.call_function(self.also_fn, n.args, n.kwargs)
                    mark_new_node(new, self.name, like=n)
                n.replace_all_uses_with(new)
                gm.graph.erase_node(n)


class ThreeBranches(nn.Module):
    def forward(self, small, large, other):
        return torch.tanh(small).sum() + F.softmax(large, dim=-1).sum() + torch.relu(other).sum()


def test_a_pass_measured_on_the_whole_step_is_ordered_by_all_it_changes():
    small, large, other = torch.randn(4, 4), torch.randn(512, 2048), torch.randn(4, 4)
    clock = OriginalsOnTheWall({"cool": 0.5, "hot": 0.5})
    fast = rewriter.optimize(ThreeBranches(), (small, large, other),
                             passes=[Replace("cool", torch.tanh),
                                     ReplaceAndRetouch("hot", F.softmax, torch.relu)],
                             clock=clock, gate=dataclasses.replace(QUICK, negligible=0.0),
                             profile=False, progress=False, knowledge_base=False)
    hot = next(d for d in fast.report.decisions if d.pass_name == "hot")
    assert hot.scope == "step" and "not local" in hot.reason and hot.kept
    # its softmax is ~10 000 times the tanh: measured first, though registered second
    measured = [s[0] for s in clock.seen if len(s) == 1 and s[0] in ("cool", "hot")]
    assert measured[0] == "hot" and "cool" in measured


class LinearThenMm(nn.Module):
    """A linear (bf16 under the precision pass's casts), its output into a matmul with an fp32
    weight of the model's own, and a small tanh on the side."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.w = nn.Linear(256, 256), nn.Parameter(torch.randn(256, 256) / 16)

    def forward(self, x, small):
        return torch.matmul(self.fc(x), self.w).sum() + torch.tanh(small).sum()


def test_the_scan_times_each_region_in_the_precision_its_values_were_recorded_in():
    """Deciding in bf16 (the precision pass applied speculatively), the recording run holds the
    linear's output in bf16: the matmul region timed as captured (its weight fp32) raised on it,
    and every pass was measured as registered (GPT-2's attention, bf16). Timed with the
    precision's casts written in, the hot matmul goes first."""
    from tests.controlled import Bf16Cpu

    torch.manual_seed(0)
    clock = OriginalsOnTheWall({"cool": 0.5, "hot": 0.5, "cast_to_half": 0.5})
    hot = Replace("hot", torch.matmul)
    hot.fn = torch.matmul  # itself, so the precision's casts apply to the replacement as well
    rewriter.optimize(LinearThenMm(), (torch.randn(256, 256), torch.randn(4, 4)),
                      passes=[Replace("cool", torch.tanh), hot, "cast_to_half"],
                      dtype=torch.bfloat16, device=Bf16Cpu(), clock=clock,
                      gate=dataclasses.replace(QUICK, negligible=0.0), profile=False, progress=False,
                      knowledge_base=False)
    measured = [p for s in clock.seen for p in s if p in ("cool", "hot")]
    assert measured and measured[0] == "hot", measured


class CountsOriginals(ControlledClock):
    """A controlled clock that counts the one-call timings of original regions (the scan's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.originals = 0

    def time(self, step):
        self.originals += step.label == "original region, one call"
        return super().time(step)


def test_regions_of_two_passes_over_the_same_nodes_are_timed_once_in_the_scan():
    """onednn_linear and reuse_linear_output both cut an LM head's Linear out: one original,
    timed once, its figure serving both passes' order and decisions."""
    small, large = torch.randn(4, 4), torch.randn(512, 2048)
    clock = CountsOriginals({"a": 0.5, "b": 0.5})
    fast = rewriter.optimize(SmallThenLarge(), (small, large),
                             passes=[Replace("a", F.softmax), Replace("b", F.softmax)],
                             clock=clock, gate=dataclasses.replace(QUICK, negligible=1e-9),
                             profile=False, progress=False, knowledge_base=False)
    # one original, timed once: the fastest of three timings (a call of ~10 ms on this clock,
    # under site_gate.ONE_CALL_IS_ENOUGH_S); the decision takes the scan's figure
    assert clock.originals == 3
    assert fast.report.decisions[0].pass_name == "a" and fast.report.decisions[0].kept
