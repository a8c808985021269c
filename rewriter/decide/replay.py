"""Plans: the run's fingerprint, which plan (given, or from the decision cache) replays, and
replaying one, or the kept passes onto a graph Dynamo hands over later. A mixin of
:class:`rewriter.pipeline.Run`, and the functions the wrapper replays with.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from rewriter import plan as plans
from rewriter.capture.front_ends import GraphSlot
from rewriter.capture.ir import structure_signature
from rewriter.decide.job import Job, switched
from rewriter.decide.kept import KeptPass, build, overlay_for
from rewriter.devices import optimizers
from rewriter.errors import PlanError
from rewriter.pass_api import PassContext, registered_passes
from rewriter.report import Decision, Report

log = logging.getLogger("rewriter.progress")


class PlanReplay:
    """Run's methods that fingerprint the run and replay a plan."""

    # --- plans -------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        job = self.job
        fp = {"device": job.backend.name, "versions": job.backend.versions(),
              "machine": job.backend.machine(), "mode": job.mode,
              "dtype": str(job.dtype) if job.dtype else None,
              "inputs": plans.input_signature(job.args, job.kwargs), "front_end": self.cap.front_end,
              "graphs": plans.graph_hash(structure_signature(s.original) for s in self.cap.slots),
              "tensors": plans.tensor_hash(job.model),  # the op names leave out the widths
              "pass_versions": {p.name: p.version for p in self.passes}}
        if job.generation is not None:  # a step of 1 + n calls weighs the graphs otherwise
            fp["decode_calls"] = job.generation.decode_calls
        if self.settings.objective != "time":  # the same graphs decide differently on memory
            fp["objective"] = self.settings.objective
            fp["memory_slowdown"] = self.settings.memory_slowdown
        return fp

    def _plan_to_replay(self, fingerprint: dict) -> dict | None:
        plan = _plan_to_replay(self.settings.plan, fingerprint, self.report, self.settings.strict_plan)
        if plan is None and self.settings.cache_dir is not None:
            plan = plans.cached_plan(self.settings.cache_dir, fingerprint)
            if plan is not None:
                self.report.plan_status = f"from the decision cache in {self.settings.cache_dir}"
        return plan

    def _replay(self, plan: dict) -> None:
        known = registered_passes()
        unknown = [n for n in plan["kept_passes"] if n not in known]
        if unknown:
            raise PlanError(f"plan keeps passes this installation does not have: {unknown}")
        sites_of = plan.get("kept_sites") or {}
        kept: list[KeptPass] = []
        for name in plan["kept_passes"]:
            kp = KeptPass.from_dict(known[name], sites_of.get(name))
            self.rebuild(kept + [kp])
            sites = [d for d in _sites_of(plan, name)]
            with switched(self.cap.switch):
                ok, detail, err = self._verify_candidate(composed=True)
            status = "replayed" if ok else "failed verification"
            self.report.decisions.append(Decision(
                name, ok, status, detail if not ok else "from plan, not measured", max_abs_error=err,
                sites=sites, verification=detail if ok else "", scope=kp.pass_.scope))
            if ok:
                kept.append(kp)
        self.rebuild(kept)
        if self.job.optimizer is not None:
            self.fused_opt = _replay_optimizer(plan, self.job, self.report)
        self.report.final = {"kept": bool(kept) or self.fused_opt is not None,
                             "reason": "replayed plan (not measured)"}
        replayed = f"replayed {[kp.name for kp in kept]} without measuring"
        self.report.plan_status = (f"{self.report.plan_status}: {replayed}" if self.report.plan_status
                                   else replayed)


def _sites_of(plan: dict, name: str) -> list[str]:
    for d in plan.get("decisions", []):
        if d.get("pass_name") == name and d.get("kept"):
            return list(d.get("sites", []))
    return []


def replay_on_slot(slot: GraphSlot, kept: list[KeptPass], ctx: PassContext) -> None:
    """Apply the kept decisions to a graph captured after deciding (new shapes, mode), unmeasured."""
    try:
        slot.set_overlay(None)
        slot.set_kept(build(slot.original, kept, ctx, slot.name))
        slot.set_overlay(overlay_for(kept, ctx))
    except Exception as e:
        slot.set_overlay(None)
        slot.set_kept(slot.original)
        log.warning("rewriter: the kept rewrites could not be replayed on %s (%s); left unrewritten",
                    slot.name, e)


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
                                     sites=[wanted], scope="step"))
    return match


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
    if strict or "machine" not in expected:
        # Ranks run rank 0's decisions whatever host they are on (different graphs on different
        # ranks would hang collectives); a plan from before machines were recorded names none.
        expected.pop("machine", None)
        actual.pop("machine", None)
    mismatch = plans.fingerprint_mismatch(expected, actual)
    if mismatch and strict:
        raise PlanError("this rank's model or inputs differ from rank 0's, so it cannot run the "
                        "same rewrites: " + "; ".join(mismatch))
    if mismatch:
        report.plan_status = "not applied, fingerprint differs (" + "; ".join(mismatch) + "); measured instead"
        log.warning("rewriter: plan not applied: %s", "; ".join(mismatch))
        return None
    return plan
