"""The compile decided first, where kept it would supersede every eager rewrite.

In bf16 training under a regional capture the one compile candidate is the original model
under autocast, compiled whole (rewriter.decide.compile_gate); kept, it supersedes the graph
rewrites and the precision pass, whose rows then read "superseded". Deciding them first was
most of optimize()'s own time beside the compile: cold, 4 layers, 2-core Xeon with AMX,
`.diag`-style timelines of optimize(dtype=bf16, steps=20000): LLaMA 8.0 s before the compile
started (the passes 1.8 s, the precision on the whole step 2.5 s, the composed step check
0.8 s), GPT-2 7.0 s. So, where the compile is predicted to repay within the run, it is decided
right after the fused optimizer::

    if not compile_first(run, passes):   # True: kept, nothing else to decide
        ...decide the passes, the step check, then CompileGate(run).decide()

1. compiled and verified as always (:meth:`CompileGate.attempt`);
2. timed against the model's own code, eager, under the same autocast, with the kept fused
   optimizer (``job.UnderAutocast``): kept when faster by the compile margin and repaid
   within the run, as any compile;
3. then the step check against the user's original step (rewriter.decide.confirm.step_check):
   measurably slower, twice, and it is not kept.

Not kept (slower, not repaid, raised, failed verification or the step check), the passes and
the precision are decided as before, within the deciding budget they had before it (the time the
compile took is added back), and the compile gate does not pay the same compile again.
What is given up: the eager bf16 rewrites are not timed against the compiled form. On the
benchmark families that form was 1.07-1.38x faster than the rewritten eager bf16 step
(`benchmarks/COMPILE_FAMILIES_BF16.md`); a model where the rewritten eager step beats it would
keep the compile, measured faster than the eager step under autocast and the original one.
"""
from __future__ import annotations

import logging
import time

import torch

from rewriter.capture.regional import RegionalCapture
from rewriter.decide.compile_gate import CompileGate
from rewriter.decide.confirm import step_check
from rewriter.decide.gate import Step, figure
from rewriter.decide.job import UnderAutocast, switched
from rewriter.decide.run_view import RunView
from rewriter.devices.executors import executors_for
from rewriter.pass_api import Pass
from rewriter.report import Decision

log = logging.getLogger("rewriter.progress")


def compile_first(run: RunView, passes: list[Pass]) -> bool:
    """Decide the compile before the passes where it would supersede them (the module's
    docstring). True: kept and installed, every pass's row written; False: decide as usual
    (``run.compiled_first`` holds the row of a compile tried and not kept)."""
    precision = _precision(run, passes)
    if precision is None:
        return False
    found, _ = executors_for(run.job.backend, True if run.settings.compile == "auto" else run.settings.compile,
                             run.job.training)
    if len(found) != 1:  # none, or several to compare: the usual order
        return False
    ex, gate = found[0], CompileGate(run)
    gate.under_autocast = True
    autocast = gate._autocast()
    gate.baseline = _eager_step(run, autocast, precision.name)
    steps = gate.steps()
    key, known, skip, predicted = gate.weighed(ex, True, run.settings.compile, steps)
    if skip is not None:  # decided with the passes, as before
        return False
    log.info("rewriter: compile decided first: it would supersede every eager rewrite")
    started = time.perf_counter()
    d, runner, ex, _ = gate.attempt(ex, steps, key, known, True, predicted)
    d.reason = f"decided first, against the eager step under autocast: {d.reason}"
    m = None
    if d.kept:
        m, slower, _ = step_check(run, lambda: gate._step(runner))
        if slower:
            d.kept, d.status = False, "rejected"
            d.reason = f"slower than the original step ({figure(m)}); {d.reason}"
    log.info("rewriter: compile (%s): %s: %s", d.sites[0] if d.sites else ex.name, d.status, d.reason)
    if not d.kept:  # its row goes beside the compile gate's (CompileGate.decide)
        run.compiled_first = d
        if run.deadline is not None:  # the passes get the budget they had before it, as the
            run.deadline += time.perf_counter() - started  # compile after them never took theirs
        return False
    optimizer_rows = run.report.decisions
    run.report.decisions = [_not_decided(p, run, d) for p in passes] + optimizer_rows + [d]
    gate._prefer_original(d, runner)
    gate._install(runner, ex)
    run.report.final.update(
        kept=True, measurement=m.to_dict(), speedup=m.speedup, noise=m.noise, step_ms=m.baseline_ms,
        reverted=[], reason=f"confirmed on the whole step: {figure(m)}: the original model compiled "
                            f"({d.sites[0]}), decided before the eager rewrites")
    return True


def _precision(run: RunView, passes: list[Pass]) -> Pass | None:
    """The precision pass whose kept form would be the original model under autocast, compiled
    whole (training, bf16, a regional capture, the time objective, a compile allowed and weighed
    against the run's length), or None: no compile decided first."""
    s, job = run.settings, run.job
    if s.compile is False or s.objective != "time" or not job.training or job.generation is not None \
            or job.dtype is not torch.bfloat16 or not isinstance(run.cap, RegionalCapture) \
            or not (s.compile == "auto" or s.steps is not None):
        return None
    return next((p for p in passes if p.sets_precision and p.applies_to(run.ctx) is None), None)


def _eager_step(run: RunView, autocast: tuple[str, torch.dtype], precision: str) -> Step:
    """The original model's step, eager, under ``autocast``, with the kept fused optimizer."""
    twin = run.fused_opt.twin(run.job.optimizer) if run.fused_opt is not None else None
    inner = run.job.step(UnderAutocast(run.job.model, autocast), optimizer=twin)

    def go() -> None:
        with switched(run.cap.switch, use_candidate=False):
            inner()
    return Step(go, (("fuse_optimizer",) if run.fused_opt else ()) + (precision,), "eager, autocast")


def _not_decided(p: Pass, run: RunView, compiled: Decision) -> Decision:
    why_not = p.applies_to(run.ctx)
    if why_not:
        return Decision(p.name, False, "not applicable", why_not, scope=p.scope)
    return Decision(p.name, False, "not tried",
                    f"not measured: the original model compiled ({compiled.sites[0]}) was decided "
                    "first and kept; it runs the model's own code, so a graph rewrite would be "
                    "superseded", scope=p.scope)
