"""Controlled clocks and passes: the gate's decisions, tested without wall-clock timing."""
from __future__ import annotations

import math
import random
from typing import Callable

import torch
import torch.nn.functional as F
from torch.fx import GraphModule

from rewriter import GateSettings, Pass, PassContext, PassError, Site
from rewriter.capture.ir import mark_new_node
from rewriter.decide.gate import Step
from rewriter.devices.backends import CpuBackend

# Few pairs, no warm-up time: the controlled clock needs neither.
QUICK = GateSettings(warmup=1, warmup_seconds=0.0, max_warmup=1, min_pairs=4, max_pairs=6,
                     budget_seconds=60.0)


class Bf16Cpu(CpuBackend):
    """The CPU backend as on a CPU with native bf16 GEMMs (AVX512-BF16/AMX), so precision
    decisions are exercised on any CPU; the timings come from a controlled clock."""

    amp_dtypes = (torch.bfloat16,)


class ControlledClock:
    """Runs each step (so the code path is real) and reports a time set by its passes.

    A step's time is ``base * prod(costs[p] for p in step.passes)``, with a small seeded jitter
    so the noise estimate is exercised. ``step_costs`` (by pass) replace ``costs`` for whole
    steps (``step.scope == "step"``), so a region can look faster than its composed step is.
    ``interference(call, step)`` multiplies a sample's time (a burst of load from another
    process); ``interrupt_after`` raises KeyboardInterrupt then.
    ``peaks`` (by pass) multiply ``base_bytes`` for :meth:`peak_bytes`, the step's peak memory
    (the memory objective's measurement, injected instead of profiled). ``faults(call, step)``:
    the page faults a sample takes (this process's own), read through :meth:`page_faults`;
    without it the clock counts none (None), as on a platform that does not.
    """

    def __init__(self, costs: dict[str, float] | None = None, base: float = 0.010,
                 jitter: float = 0.005, interrupt_after: int | None = None,
                 step_costs: dict[str, float] | None = None,
                 interference: Callable[[int, Step], float] | None = None,
                 peaks: dict[str, float] | None = None, base_bytes: int = 100 * 2**20,
                 faults: Callable[[int, Step], int] | None = None) -> None:
        self.costs = costs or {}
        self.step_costs = step_costs or {}
        self.base, self.jitter = base, jitter
        self.rng = random.Random(0)
        self.calls = 0
        self.interrupt_after = interrupt_after
        self.interference = interference
        self.seen: list[tuple[str, ...]] = []
        self.scopes: list[str] = []
        self.peaks, self.base_bytes = peaks or {}, base_bytes
        self.peaks_seen: list[tuple[str, ...]] = []
        self.faults, self.fault_count = faults, 0

    def page_faults(self) -> int | None:
        return self.fault_count if self.faults is not None else None

    def peak_bytes(self, step: Step) -> int:
        """Runs the step and reports its peak memory: ``base_bytes * prod(peaks[p])``
        (exact: peak memory of a step does not jitter the way its time does)."""
        step.run()
        self.peaks_seen.append(step.passes)
        return int(self.base_bytes * math.prod(self.peaks.get(p, 1.0) for p in step.passes))

    def time(self, step: Step) -> float:
        self.calls += 1
        if self.interrupt_after is not None and self.calls > self.interrupt_after:
            raise KeyboardInterrupt
        step.run()
        self.seen.append(step.passes)
        self.scopes.append(step.scope)
        costs = {**self.costs, **self.step_costs} if step.scope == "step" else self.costs
        factor = math.prod(costs.get(p, 1.0) for p in step.passes)
        if self.interference is not None:
            factor *= self.interference(self.calls, step)
        if self.faults is not None:
            self.fault_count += self.faults(self.calls, step)
        return self.base * factor * (1 + self.jitter * self.rng.uniform(-1, 1))


class RewriteRelu(Pass):
    """Replaces each ``F.relu``/``torch.relu`` by ``F.relu`` again (or by ``wrong`` numerics)."""

    contract = "exact"

    def __init__(self, name: str, shift: float = 0.0, raise_in: str = "", broken: bool = False):
        self.name = name  # type: ignore[misc]
        self.shift, self.raise_in, self.broken = shift, raise_in, broken

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if self.raise_in == "find":
            raise PassError(f"{self.name}: cannot handle this graph")
        return [Site(n, n.name) for n in gm.graph.nodes
                if n.op == "call_function" and n.target in (F.relu, torch.relu)]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        if self.raise_in == "apply":
            raise PassError(f"{self.name}: gave up half way")
        g = gm.graph
        for site in sites:
            with g.inserting_after(site.anchor):
                if self.broken:  # a graph that fails when run
                    new = g.call_function(torch.reshape, (site.anchor, (-7, 3)))
                elif self.shift:
                    new = g.call_function(torch.add, (site.anchor, self.shift))
                else:
                    new = g.call_function(F.relu, (site.anchor,))
                mark_new_node(new, self.name, like=site.anchor)
            site.anchor.replace_all_uses_with(new)
            new.args = (site.anchor,) + tuple(new.args[1:])


class StepRelu(RewriteRelu):
    """RewriteRelu decided on the whole step (as cast_to_half and to_channels_last are)."""

    scope = "step"
