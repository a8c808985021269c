"""One-time costs against the run's length: a candidate that costs seconds once (a compile) is
worth it only if its saving per step repays that cost early in the run.

``optimize(steps=N)`` says how many steps (training) or calls (inference) the caller expects.
A one-time cost ``C`` and a saving ``s`` per step repay after ``C / s`` steps (the break-even
step); the cost is paid when that is predicted within ``REPAY_FRACTION`` of the run, so most of
the run is profit and a wrong guess of its length costs little. Once paid (a compile done and
measured faster), it is kept when its measured saving repays it within the run
(``repays_in_run``: nothing with a one-time cost is kept that does not), not thrown away for
missing the tenth by a few steps (BERT, cold: 17.8 s of compile, 8.7 ms saved a step, repaid
after 2038 steps of 20000)::

    p = Payback(cost_s=20.0, saving_s=0.030, steps=20_000)
    p.break_even, p.repays            # (667, True): repaid within the first 2000 steps
    Payback(20.0, 0.030, 100).repays  # False: a 100-step job never gets its 20 s back
    Payback(20.0, 0.009, 20_000).repays_in_run  # True: paid already, repaid by step 2223

optimize()'s own deciding is a one-time cost too: with ``steps`` known, it gets at most a
tenth of the run's length, as a compile does (:func:`deciding_budget`, never under
``MIN_BUDGET``), and a run that short is not profiled for the report unless asked
(``profile=True``).

Before compiling, the cost is predicted (:func:`predict_compile_seconds`) and the saving
bounded from above by ``MAX_SAVING`` of the step, so a job too short to repay even that best
case does not pay the compile at all. After compiling, the measured figures decide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rewriter.decide.gate import GateSettings

DEFAULT_STEPS = 1000  # steps=None with compile="auto": a short fine-tuning run
REPAY_FRACTION = 0.1  # a one-time cost must be repaid within the first tenth of the run
MAX_SAVING = 0.5  # before measuring: the most of a step a compiler is assumed to save
# Of the run's length, at most, for optimize() to decide in. It was a quarter: LLaMA with 32 000
# words, steps=100 of ~0.6 s (2-core Xeon with AMX, fp32, `.diag` runs): 13.6 s of deciding kept
# the fused optimizer (~5 s back over the run), the loss not reached (its whole-step pairs did not
# fit), so the run took longer than eager's; a tenth (the floor, 8 s) keeps the same, for less.
BUDGET_FRACTION = REPAY_FRACTION
MIN_BUDGET = 8.0  # seconds: capture and the first measurements of a small transformer
# Deciding the other passes in the precision to come, then the precision on the whole step
# (rewriter.pipeline.Run._decide), takes ~40 of the model's steps (the precision's verification
# and ~9 rounds of a full-precision and a half step; the regions' pairs); with fewer than this
# many steps' time left in the budget, the precision pass, the largest saving, is decided first.
PRECISION_FIRST_STEPS = 50
# A warm persistent Inductor cache (rewriter.devices.compile_cache): `python -m
# benchmarks.compile_cache` gave 5.1 s against 24.1 s cold (llama, training, 2-core AMD EPYC,
# torch 2.13), 0.21; the regional compile, once its graphs were cacheable (rewriter.devices.
# dynamo_inputs), 2.5 s against 20.0 s (2-core Xeon), 0.13. Assumed 0.25: the larger, so a
# prediction errs towards not paying.
WARM_FACTOR = 0.25
# A paid one-time cost's comparison goes on, while its figures do not yet decide it, for up to
# this share of what was paid (never under the gate's budget of one comparison): the cost is
# sunk, and a keep near the margin is worth the run's every step. GLM's regional compile, fp32,
# 2-core AMD EPYC, five processes: 1.08x ±0.026 / 1.078x ±0.007 / 1.114x ±0.037 kept in 6
# pairs, "busy" once, and rejected in the benchmark's process; ModernBERT's 1.042x ±0.021
# "within noise" after the 4 s budget's 9 pairs, 1.031x ±0.013 kept after 11 in another.
PAID_MEASURE_SHARE = 0.5

# Inductor's first compile of one graph, in a fresh process with a cold cache: seconds =
# base + per_node * nodes (nodes: the Dynamo graph's calls; training includes AOTAutograd's
# backward). Fitted on 2-core AMD EPYC (avx512_bf16, no AMX), torch 2.13, Inductor C++:
# MLP graphs of 6, 24 and 72 nodes took 13.3, 17.1 and 27.0 s in training. Inference fitted on
# a 2-core Intel Xeon (avx512_bf16, no AMX), torch 2.13, ISA checks built side by side
# (rewriter.devices.isa_probes; `.diag`-style script: Linear, GELU, LayerNorm, eval, no_grad):
# 6, 24, 72 and 144 nodes took 6.7, 7.7, 9.9 and 14.7 s; a transformer's decode forward (Qwen2,
# 3 layers, ~250 nodes, many of them views) took 12.0-12.7 s, under the fit's 21.5 s. Used on
# every device until the knowledge base has the device's own figure for the same graphs. Fitted
# before Inductor's CPU kernels were built a few to a program (rewriter.devices.kernel_batches:
# a cold BERT compile's first step 28 -> 21.5 s): left as it was, it errs towards not paying.
COMPILE_COST = {  # training: (base seconds, seconds per node)
    True: (12.0, 0.21),
    False: (6.5, 0.06),  # inference: forward only
}
# A node the compiler is handed again (a block's later instances, unrolled by a whole-model
# trace) costs this fraction of a node's seconds: its kernels are the first instance's, built
# once, so only tracing and lowering repeat. LLaMA, torch.compile of the whole model, training,
# fp32, cold cache, a process each (2-core Xeon with AMX, `.diag` run): 1 layer (112 nodes)
# 20.1 / 20.4 s, 4 layers (325 nodes, 213 of them the three later layers) 26.3 / 26.3 s:
# 0.029 s a repeated node, 0.14 of the training fit's 0.21 s (the fit alone predicted 80 s for
# the 4 layers). Inference is assumed the same fraction.
REPEATED_NODE_FACTOR = 0.15
# The same under a nested compile region a block class (the original model compiled whole with
# its repeated blocks nested, rewriter.capture.install): the later instances reuse the first's
# compiled region, so only Dynamo's check of each call repeats. LLaMA, bf16 autocast, training,
# cold, a process each (2-core Xeon with AMX; `benchmarks.layer_compile --layers N`): 1 / 4 / 8
# layers 26.7 / 29.4 / 31.2 s nested (whole: 24.8 / 34.5 / 43.8 s), ~0.6 s a later layer of ~71
# nodes: 0.04 of the fit's seconds a node.
NESTED_NODE_FACTOR = 0.04
# A compile still running at this many times its prediction, where that is past what the best
# saving repays within the run's first tenth, is abandoned (:func:`compile_time_limit`). The
# predictions err high (Gemma 2's regional compile: 68 s predicted, 22.8 s taken); Funnel's ran
# past nine minutes (rewriter.devices.compile_limit).
OVERRUN_FACTOR = 3.0


@dataclass(frozen=True)
class Payback:
    """A one-time cost against a saving per step over a run of ``steps`` steps."""

    cost_s: float
    saving_s: float
    steps: int

    @property
    def break_even(self) -> float:
        """Steps until the saving has paid the cost (inf when nothing is saved)."""
        if self.saving_s <= 0:
            return math.inf
        return self.cost_s / self.saving_s

    @property
    def repays(self) -> bool:
        """Repaid within the first ``REPAY_FRACTION`` of the run: worth paying."""
        return self.break_even <= REPAY_FRACTION * self.steps

    @property
    def repays_in_run(self) -> bool:
        """Repaid before the run ends: worth keeping once paid."""
        return self.break_even <= self.steps

    def describe(self, paid: bool = False) -> str:
        """In words; ``paid``: against the whole run (the cost already paid), else its tenth."""
        be = "never" if math.isinf(self.break_even) else f"after {math.ceil(self.break_even)} steps"
        if paid:
            verdict = "within" if self.repays_in_run else "not within"
            return (f"{self.cost_s:.1f} s once (paid), {1e3 * self.saving_s:.2f} ms saved a step: "
                    f"repaid {be}, {verdict} the run's steps={self.steps}")
        within = math.floor(REPAY_FRACTION * self.steps)
        verdict = "within" if self.repays else "not within"
        return (f"{self.cost_s:.1f} s once, {1e3 * self.saving_s:.2f} ms saved a step: repaid {be}, "
                f"{verdict} the first {within} of steps={self.steps}")

    def to_dict(self) -> dict:
        be = None if math.isinf(self.break_even) else math.ceil(self.break_even)
        return {"one_time_seconds": round(self.cost_s, 3), "saving_ms": round(1e3 * self.saving_s, 4),
                "break_even_step": be, "steps": self.steps, "repays": self.repays,
                "repays_in_run": self.repays_in_run}


def predict_compile_seconds(nodes: int, training: bool, known_s: float | None = None,
                            warm: bool = False, repeated: int = 0, nested: bool = False) -> float:
    """The first compile's seconds: the knowledge base's figure for the same graphs when there
    is one (``WARM_FACTOR`` of it when Inductor's persistent cache is the one it was measured
    with), else the table's fit on the graphs' node count, the ``repeated`` of them (handed to
    the compiler again, rewriter.decide.compile_size.repeated_nodes) at
    ``REPEATED_NODE_FACTOR``, or ``NESTED_NODE_FACTOR`` where the blocks are ``nested``."""
    if known_s is not None:
        return known_s * (WARM_FACTOR if warm else 1.0)
    base, per_node = COMPILE_COST[training]
    factor = NESTED_NODE_FACTOR if nested else REPEATED_NODE_FACTOR
    return base + per_node * (nodes - repeated + factor * repeated)


def deciding_budget(time_budget: float | None, steps: int | None, step_seconds: float) -> float | None:
    """The seconds optimize() may spend deciding: ``time_budget``, and with ``steps`` known at
    most ``BUDGET_FRACTION`` of the run (``steps`` steps of ``step_seconds``), at least
    ``MIN_BUDGET``."""
    if steps is None:
        return time_budget
    cap = max(MIN_BUDGET, BUDGET_FRACTION * steps * step_seconds)
    return cap if time_budget is None else min(time_budget, cap)


def compile_time_limit(steps: int | None, step_seconds: float, predicted_s: float) -> float | None:
    """Seconds a compile may run before it is abandoned (None: no limit, the run's length
    unknown): what the best saving, ``MAX_SAVING`` of each step, repays within the run's first
    ``REPAY_FRACTION`` (the rule a compile is paid under, :attr:`Payback.repays`), and never under
    ``OVERRUN_FACTOR`` times the compile's prediction::

        compile_time_limit(20_000, 0.25, 40.0)  # 250.0: the tenth's 2000 steps of 0.125 s saved
        compile_time_limit(1_000, 0.25, 40.0)   # 120.0: three times the prediction
    """
    if steps is None:
        return None
    return max(REPAY_FRACTION * steps * MAX_SAVING * step_seconds, OVERRUN_FACTOR * predicted_s)


def check_steps(steps: object) -> int | None:
    """``optimize(steps=...)``: None or a positive int."""
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (the steps or calls the run will make) "
                         f"or None, got {steps!r}")
    return steps


def measuring_paid(settings: "GateSettings", paid_seconds: float) -> "GateSettings":
    """``settings`` for comparing a candidate that has cost ``paid_seconds`` once: its pairs
    may run for :data:`PAID_MEASURE_SHARE` of that (stopping, as ever, once conclusive)::

        measure(eager, compiled, settings=measuring_paid(g, compile_s), ...)
    """
    return replace(settings, budget_seconds=max(settings.budget_seconds,
                                                PAID_MEASURE_SHARE * paid_seconds))
