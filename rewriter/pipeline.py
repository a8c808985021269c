"""The optimize loop: capture, then for each pass apply ▶ verify ▶ measure ▶ keep|revert.

A plain loop over passes in a fixed order, greedy: each candidate is measured against the
current kept state. At the end the whole optimized model is measured once more against the
original; if it is not faster, the original model is what runs. Everything happens inside
:func:`rewriter.state.preserved_state`, so the user's model, optimizer and RNG come out as
they went in, also when a pass raises or the user interrupts.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rewriter import amp, optimizers
from rewriter import plan as plans
from rewriter.advisor import advise
from rewriter.capture import Capture, DynamoCapture, FxCapture, GraphSlot, capture
from rewriter.errors import CaptureError, PlanError
from rewriter.gate import Clock, GateSettings, Step, WallClock, decide, measure
from rewriter.ir import structure_signature
from rewriter.job import Job, switched
from rewriter.pass_api import Pass, PassContext, registered_passes
from rewriter.profiling import ProfileSettings, compare, profile_run
from rewriter.report import Decision, Report
from rewriter.state import preserved_state
from rewriter.verify import (
    AUTOCAST_FACTOR,
    FLOAT64_FACTOR,
    Tolerance,
    Yardstick,
    compare_runs,
    tolerance_for,
)

log = logging.getLogger("rewriter.progress")


@dataclass
class Settings:
    """How optimize() measures and decides (the keyword options of optimize())."""

    min_speedup: float = 1.03
    front_end: str = "auto"
    gate: GateSettings = field(default_factory=GateSettings)
    clock: Clock | None = None
    profile: bool = True
    plan: Any = None
    replace_optimizer: bool = True  # False when optimize() already handed the optimizer back
    cache_dir: str | None = None  # decision cache: plans by fingerprint
    strict_plan: bool = False  # a plan that does not fit is an error (other ranks follow rank 0)


@dataclass
class Outcome:
    """What the wrapper needs after the loop: how to run the optimized model, and the report."""

    report: Report
    capture: Capture | None
    kept: list[Pass]
    use_original: bool
    context: PassContext
    optimizer: torch.optim.Optimizer | None = None  # what optimize() returns beside the model
    loss_scale: amp.DynamicLossScale | None = None  # fp16 training: scales gradients from outputs


def run_pipeline(job: Job, passes: list[Pass], settings: Settings) -> Outcome:
    started = time.perf_counter()
    report = Report(model=type(job.model).__name__, device=job.backend.name, mode=job.mode,
                    dtype=str(job.dtype).replace("torch.", "") if job.dtype else None)
    clock = settings.clock or WallClock(job.backend.synchronize)
    ctx = PassContext(job.backend, job.training, job.dtype)
    kept: list[Pass] = []
    with preserved_state(job.model, job.optimizer, job.backend.rng_states()) as snapshot:
        reference = Reference(job, snapshot)
        try:
            cap = _checked_capture(job, settings.front_end, reference, report)
        except CaptureError as e:
            report.front_end_reason = str(e)
            report.final = {"kept": False, "reason": f"capture failed: {e}"}
            report.plan = plans.make_plan({}, [], [])
            log.warning("rewriter: %s; the original model will run", e)
            report.optimize_seconds = time.perf_counter() - started
            return Outcome(report, None, [], True, ctx, job.optimizer)
        snapshot.restore()
        if isinstance(cap, DynamoCapture):
            cap.on_new_graph = lambda slot: replay_on_slot(slot, kept, ctx)
        fingerprint = _fingerprint(job, cap, passes)
        plan = _plan_to_replay(settings.plan, fingerprint, report, settings.strict_plan)
        if plan is None and settings.cache_dir is not None:
            plan = plans.cached_plan(settings.cache_dir, fingerprint)
            if plan is not None:
                report.plan_status = f"from the decision cache in {settings.cache_dir}"
        if plan is not None:
            kept[:] = _replay(plan, cap, job, ctx, reference, report)
            fused_opt = _replay_optimizer(plan, job, report) if job.optimizer is not None else None
            report.final = {"kept": bool(kept) or fused_opt is not None, "reason": "replayed plan (not measured)"}
            use_original = False
        else:
            kept[:] = _try_passes(passes, cap, job, ctx, reference, clock, settings, report, snapshot)
            fused_opt = _try_optimizer(job, clock, settings, report, snapshot)
            use_original = not _final_check(job, cap, kept, fused_opt, clock, settings, report)
            snapshot.restore()
        if use_original:
            kept[:], fused_opt = [], None
        if settings.profile:
            _profile(job, cap if kept else job.model, report, _fused_twin(job, fused_opt),
                     optimized=bool(kept) or fused_opt is not None)
            snapshot.restore()
        report.graphs = len(cap.slots)
        report.plan = plans.make_plan(fingerprint, [p.name for p in kept],
                                      [d.to_dict() for d in report.decisions],
                                      fused_opt.description if fused_opt else None)
    if settings.cache_dir is not None and plan is None:
        plans.cache_plan(settings.cache_dir, fingerprint, report.plan)
    optimizer = job.optimizer
    if fused_opt is not None:
        optimizer = fused_opt.switch(job.optimizer)  # after the snapshot: this change stays
        report.notes.append(f"optimizer: {fused_opt.description}")
    loss_scale = _loss_scaling(job, kept, optimizer, report)
    report.optimize_seconds = time.perf_counter() - started
    log.info("rewriter: done in %.1f s: %s", report.optimize_seconds, report.final.get("reason", ""))
    return Outcome(report, cap, list(kept), not kept, ctx, optimizer, loss_scale)


def _loss_scaling(job: Job, kept: list[Pass], optimizer: torch.optim.Optimizer | None,
                  report: Report) -> amp.DynamicLossScale | None:
    """fp16 training with half-precision GEMMs kept: dynamic loss scaling, the loop unchanged."""
    if not (job.training and job.dtype == torch.float16 and any(p.name == "cast_to_half" for p in kept)):
        return None
    if optimizer is None:
        report.notes.append("fp16 training without optimizer=: no loss scaling (gradients may "
                            "underflow); pass the optimizer to optimize() to get it")
        return None
    scaler = amp.DynamicLossScale()
    amp.attach_loss_scaling(optimizer, scaler)
    report.notes.append(f"fp16 dynamic loss scaling on (initial scale {scaler.scale:g}); "
                        "optimizer.step() skips a step whose gradients overflow")
    return scaler


def _try_passes(passes: list[Pass], cap: Capture, job: Job, ctx: PassContext, reference: Reference,
                clock: Clock, settings: Settings, report: Report, snapshot: Any) -> list[Pass]:
    """The greedy loop: each pass is measured against the rewrites kept before it."""
    kept: list[Pass] = []
    for i, p in enumerate(passes, 1):
        decision = _try_pass(p, cap, job, ctx, reference, kept, clock, settings)
        snapshot.restore()
        report.decisions.append(decision)
        log.info("rewriter: [%d/%d] %s: %s: %s", i, len(passes), p.name, decision.status,
                 decision.reason)
        if decision.kept:
            kept.append(p)
    return kept


class Reference:
    """The original model's numerics, and a yardstick run computed when first needed."""

    def __init__(self, job: Job, snapshot: Any) -> None:
        try:
            self.values = job.numerics(job.model)
        except Exception as e:
            raise ValueError(f"the model cannot run on the example inputs "
                             f"({type(e).__name__}: {e})") from e
        snapshot.restore()
        self._job, self._snapshot = job, snapshot
        self._yardstick: Yardstick | None = None
        self._tried = False

    def yardstick(self) -> Yardstick | None:
        """float64 for fp32 verification, torch.autocast for ``dtype=`` (see rewriter.verify);
        None where that run is not possible."""
        if not self._tried:
            self._tried = True
            if self._job.dtype is None:
                values, label, factor = self._job.float64_numerics(), "float64", FLOAT64_FACTOR
            else:
                values, label, factor = self._job.autocast_numerics(), "torch.autocast", AUTOCAST_FACTOR
            self._snapshot.restore()
            if values is not None:
                self._yardstick = Yardstick(label, values, factor)
        return self._yardstick


def _checked_capture(job: Job, front_end: str, reference: Reference, report: Report) -> Capture:
    """Capture, and check the captured model computes what the model does (else fall back)."""
    log.info("rewriter: capturing %s (%s step)", type(job.model).__name__, job.mode)
    cap = capture(job.model, job.args, job.kwargs, front_end)
    if isinstance(cap, FxCapture):
        cap.restore_output_type(job.output_type)
    problem = _capture_mismatch(job, cap, reference)
    if problem and cap.front_end == "fx" and front_end == "auto":
        cap = DynamoCapture(job.model, f"symbolic_trace graph differs from the model ({problem})")
        problem = _capture_mismatch(job, cap, reference)
    if problem:
        raise CaptureError(f"{cap.front_end} capture differs from the model: {problem}")
    if not cap.slots:
        raise CaptureError("Dynamo handed over no graph (torch._dynamo's recompile limit reached, "
                           "or nothing in forward is capturable)")
    if isinstance(cap, DynamoCapture):
        _require_stable_graphs(job, cap)
    report.front_end, report.front_end_reason = cap.front_end, cap.reason
    report.left_as_modules = sorted(set(cap.left_as_modules))
    log.info("rewriter: front-end %s (%s), %d graph(s)", cap.front_end, cap.reason, len(cap.slots))
    return cap


def _require_stable_graphs(job: Job, cap: DynamoCapture) -> None:
    """A second call on the same inputs must reuse the graphs. If Dynamo compiles again, its
    guards read Python state that changes per call (a hook counting calls, a step counter
    attribute): past its recompile limit it runs the model eagerly, and every rewrite would be
    kept on paper but never run."""
    before = len(cap.slots)
    with switched(cap.switch, deterministic=True):
        job.numerics(cap, deterministic=contextlib.nullcontext())
    if len(cap.slots) > before:
        raise CaptureError("Dynamo recompiles the model at every call (its guards read Python "
                           "state that changes per call, such as a hook that counts calls or a "
                           "step counter attribute), so a rewrite could not stay in effect")


def _capture_mismatch(job: Job, cap: Capture, reference: Reference) -> str:
    try:
        with switched(cap.switch, deterministic=True):
            got = job.numerics(cap, deterministic=contextlib.nullcontext())
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    c = compare_runs(got, reference.values, tolerance_for(torch.float32))
    return "" if c.ok else c.problem


def _verify_candidate(job: Job, cap: Capture, reference: Reference) -> tuple[bool, str, float | None]:
    try:
        with switched(cap.switch, use_candidate=True, deterministic=True):
            got = job.numerics(cap, deterministic=contextlib.nullcontext())
    except Exception as e:
        return False, f"candidate raised when run: {type(e).__name__}: {e}", None
    tol = tolerance_for(job.dtype)
    c = compare_runs(got, reference.values, tol)
    if not c.ok:
        c = compare_runs(got, reference.values, tol, yardstick=reference.yardstick())
    return c.ok, c.describe(), c.max_abs_error


def _try_pass(p: Pass, cap: Capture, job: Job, ctx: PassContext, reference: Reference,
              kept: list[Pass], clock: Clock, settings: Settings) -> Decision:
    why_not = p.applies_to(ctx)
    if why_not:
        return Decision(p.name, False, "not applicable", why_not)
    ctx.declined.clear()  # sites the pass matches but declines record why here
    try:
        sites = [s.description for slot in cap.slots for s in slot.try_pass(p, ctx)]
    except Exception as e:
        _reject_all(cap)
        return Decision(p.name, False, "raised", f"{type(e).__name__}: {e}")
    if not sites:
        _reject_all(cap)
        return Decision(p.name, False, "no sites", "; ".join(ctx.declined) or "no site matched")
    log.info("rewriter: %s: %d site(s); verifying and measuring", p.name, len(sites))
    ok, detail, err = _verify_candidate(job, cap, reference)
    if not ok:
        _reject_all(cap)
        return Decision(p.name, False, "failed verification", detail, max_abs_error=err, sites=sites)
    base = tuple(k.name for k in kept)
    m = measure(_variant_step(job, cap, False, base, "kept"),
                _variant_step(job, cap, True, base + (p.name,), "candidate"),
                clock=clock, settings=settings.gate, min_speedup=settings.min_speedup)
    keep, reason = decide(m, settings.min_speedup, settings.gate.noise_widths)
    for slot in cap.slots:
        slot.accept() if keep else slot.reject()
    return Decision(p.name, keep, "kept" if keep else "rejected", reason, speedup=m.speedup,
                    noise=m.noise, max_abs_error=err, sites=sites, measurement=m.to_dict(),
                    verification=detail)


def _variant_step(job: Job, cap: Capture, candidate: bool, passes: tuple[str, ...], label: str) -> Step:
    inner = job.step(cap)

    def run() -> None:
        with switched(cap.switch, use_candidate=candidate):
            inner()
    return Step(run, passes, label)


def _reject_all(cap: Capture) -> None:
    for slot in cap.slots:
        slot.reject()


def _final_check(job: Job, cap: Capture, kept: list[Pass],
                 fused_opt: optimizers.OptimizerCandidate | None, clock: Clock, settings: Settings,
                 report: Report) -> bool:
    """Measure original vs optimized once more: pairwise gains need not add up.
    Returns True when the optimized step is faster (nothing kept: False, nothing measured)."""
    if not kept and fused_opt is None:
        report.final = {"kept": False, "reason": "no rewrite was kept"}
        return False
    names = tuple(p.name for p in kept) + (("fuse_optimizer",) if fused_opt else ())
    optimized = job.step(cap if kept else job.model, optimizer=_fused_twin(job, fused_opt))

    def run_optimized() -> None:
        with switched(cap.switch, use_candidate=False):
            optimized()
    m = measure(Step(job.step(job.model), (), "original"), Step(run_optimized, names, "optimized"),
                clock=clock, settings=settings.gate, min_speedup=1.0)
    keep, reason = decide(m, 1.0, settings.gate.noise_widths)
    report.final = {"kept": keep, "speedup": m.speedup, "noise": m.noise, "reason": reason,
                    "measurement": m.to_dict()}
    log.info("rewriter: whole model vs original: %s", reason)
    return keep


def _replay_optimizer(plan: dict, job: Job, report: Report) -> optimizers.OptimizerCandidate | None:
    wanted = plan.get("optimizer")
    if not wanted:
        return None
    found, _ = optimizers.candidates(job.optimizer, job.backend)
    match = next((c for c in found if c.description == wanted), None)
    if match is None:
        raise PlanError(f"the plan switches the optimizer to {wanted}, which this optimizer "
                        f"({type(job.optimizer).__name__}) on {job.backend.name} has no form of")
    report.decisions.append(Decision("fuse_optimizer", True, "replayed", "from plan, not measured",
                                     sites=[wanted]))
    return match


def _fused_twin(job: Job, cand: optimizers.OptimizerCandidate | None) -> torch.optim.Optimizer | None:
    return cand.twin(job.optimizer) if cand is not None else None


# The bar for a fused optimizer: 5 steps within 1e-5 of the original's parameters.
OPTIMIZER_STEPS = 5
OPTIMIZER_TOLERANCE = Tolerance(rtol=1e-5, atol_scale=1e-6)


def _try_optimizer(job: Job, clock: Clock, settings: Settings, report: Report, snapshot: Any
                   ) -> optimizers.OptimizerCandidate | None:
    if job.optimizer is None:
        return None
    decision, chosen = _gate_optimizer(job, clock, settings)
    snapshot.restore()
    report.decisions.append(decision)
    log.info("rewriter: optimizer: %s: %s", decision.status, decision.reason)
    return chosen


def _gate_optimizer(job: Job, clock: Clock, settings: Settings
                    ) -> tuple[Decision, optimizers.OptimizerCandidate | None]:
    """Gate the fused forms of the job's optimizer on scratch copies; the first that passes wins."""
    found, why_none = optimizers.candidates(job.optimizer, job.backend)
    if not settings.replace_optimizer:
        found = [c for c in found if c.flags is not None]
        why_none += "; optimize() without example inputs can only switch the optimizer in place"
    if not found:
        return Decision("fuse_optimizer", False, "not applicable", why_none), None
    tried = []
    for cand in found:
        ok, detail, err = _optimizer_numerics(job.optimizer, cand)
        if not ok:
            tried.append(f"{cand.description}: failed verification ({detail})")
            continue
        base, _ = optimizers.scratch_optimizer(job.optimizer, None, seed=1)
        fused, _ = optimizers.scratch_optimizer(job.optimizer, cand, seed=1)
        m = measure(Step(base.step, (), "optimizer step"), Step(fused.step, ("fuse_optimizer",), "fused step"),
                    clock=clock, settings=settings.gate, min_speedup=settings.min_speedup)
        keep, reason = decide(m, settings.min_speedup, settings.gate.noise_widths)
        decision = Decision("fuse_optimizer", keep, "kept" if keep else "rejected",
                            f"{cand.description}: {reason}", speedup=m.speedup, noise=m.noise,
                            max_abs_error=err, sites=[cand.description], measurement=m.to_dict())
        if keep:
            return decision, cand
        tried.append(decision.reason)
    return Decision("fuse_optimizer", False, "rejected", "; ".join(tried),
                    sites=[c.description for c in found]), None


def _optimizer_numerics(optimizer: torch.optim.Optimizer, cand: optimizers.OptimizerCandidate
                        ) -> tuple[bool, str, float | None]:
    try:
        base, base_params = optimizers.scratch_optimizer(optimizer, None)
        fused, fused_params = optimizers.scratch_optimizer(optimizer, cand)
        for _ in range(OPTIMIZER_STEPS):
            base.step()
            fused.step()
    except Exception as e:
        return False, f"raised: {type(e).__name__}: {e}", None
    got = {f"param {i}": p.detach() for i, p in enumerate(fused_params)}
    want = {f"param {i}": p.detach() for i, p in enumerate(base_params)}
    c = compare_runs(got, want, OPTIMIZER_TOLERANCE)
    return c.ok, c.describe(), c.max_abs_error


# One warm-up and one active step: the report's view, not a measurement (the gate's timings
# decide; these tables explain).
REPORT_PROFILE = ProfileSettings(wait=0, warmup=1, active=1)


def _profile(job: Job, run: Any, report: Report, optimizer: torch.optim.Optimizer | None,
             optimized: bool) -> None:
    try:
        before = profile_run(job.step(job.model), job.backend, settings=REPORT_PROFILE, label="original")
        report.top_ops_before, report.findings_before = before.top(10), advise(before)
        if optimized:
            after = profile_run(job.step(run, optimizer=optimizer), job.backend,
                                settings=REPORT_PROFILE, label="optimized")
            report.top_ops_after, report.findings_after = after.top(10), advise(after)
            report.op_comparison = compare(before, after, labels=("original", "optimized"))
    except Exception as e:  # a profiler problem must not cost the user the optimization
        report.notes.append(f"profiling failed: {type(e).__name__}: {e}")


def replay_on_slot(slot: GraphSlot, kept: list[Pass], ctx: PassContext) -> None:
    """Apply kept passes to a graph captured after deciding (new shapes, mode), unmeasured."""
    for p in kept:
        try:
            if slot.try_pass(p, ctx):
                slot.accept()
        except Exception as e:
            slot.reject()
            log.warning("rewriter: %s could not be replayed on %s (%s); left unrewritten",
                        p.name, slot.name, e)


# --- plans ---------------------------------------------------------------------------------

def _fingerprint(job: Job, cap: Capture, passes: list[Pass]) -> dict:
    return {"device": job.backend.name, "versions": job.backend.versions(), "mode": job.mode,
            "dtype": str(job.dtype) if job.dtype else None,
            "inputs": plans.input_signature(job.args, job.kwargs), "front_end": cap.front_end,
            "graphs": plans.graph_hash(structure_signature(s.original) for s in cap.slots),
            "pass_versions": {p.name: p.version for p in passes}}


def _plan_to_replay(source: Any, fingerprint: dict, report: Report, strict: bool) -> dict | None:
    if source is None:
        return None
    plan = plans.load_plan(source)
    unknown = [n for n in plan["kept_passes"] if n not in registered_passes()]
    if unknown:
        where = "the plan dict" if isinstance(source, dict) else f"plan file {os.fspath(source)}"
        raise PlanError(f"{where} keeps passes this installation does not have: {unknown}")
    expected = dict(plan["fingerprint"])
    actual = dict(fingerprint)
    # Only the versions of the passes the plan keeps matter.
    kept = plan["kept_passes"]
    expected["pass_versions"] = {k: expected.get("pass_versions", {}).get(k) for k in kept}
    actual["pass_versions"] = {k: actual["pass_versions"].get(k) for k in kept}
    mismatch = plans.fingerprint_mismatch(expected, actual)
    if mismatch and strict:
        raise PlanError("this rank's model or inputs differ from rank 0's, so it cannot run the "
                        "same rewrites: " + "; ".join(mismatch))
    if mismatch:
        report.plan_status = "not applied, fingerprint differs (" + "; ".join(mismatch) + "); measured instead"
        log.warning("rewriter: plan not applied: %s", "; ".join(mismatch))
        return None
    return plan


def _replay(plan: dict, cap: Capture, job: Job, ctx: PassContext, reference: Reference,
            report: Report) -> list[Pass]:
    known = registered_passes()
    unknown = [n for n in plan["kept_passes"] if n not in known]
    if unknown:
        raise PlanError(f"plan keeps passes this installation does not have: {unknown}")
    kept: list[Pass] = []
    for name in plan["kept_passes"]:
        p = known[name]
        sites = [s.description for slot in cap.slots for s in slot.try_pass(p, ctx)]
        ok, detail, err = _verify_candidate(job, cap, reference)
        for slot in cap.slots:
            slot.accept() if ok else slot.reject()
        status = "replayed" if ok else "failed verification"
        report.decisions.append(Decision(name, ok, status, detail if not ok else "from plan, not measured",
                                         max_abs_error=err, sites=sites,
                                         verification=detail if ok else ""))
        if ok:
            kept.append(p)
    replayed = f"replayed {[p.name for p in kept]} without measuring"
    report.plan_status = f"{report.plan_status}: {replayed}" if report.plan_status else replayed
    return kept
