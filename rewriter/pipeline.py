"""The optimize run: capture ▶ sites ▶ record ▶ verify ▶ measure per signature ▶ keep|revert ▶
confirm once on the step ▶ plan and report. One object owns the job from start to end::

    outcome = Run(job, passes, settings).execute()

Each pass is tried against what was kept before it (greedy, in order; a precision pass first,
then applied on top of every later variant). A pass of scope "site" is decided per region
signature: the sites are cut out of the graph (rewriter.region), fed the values recorded in
one run of the model (rewriter.record), verified and timed on their own (rewriter.site_gate),
and identical sites are measured once, or not at all when the knowledge base already knows
the signature. A pass of scope "step" and the fused optimizer are measured on the whole step
(the optimizer on its own step). At the end the composed model is verified once and timed
once against the original (rewriter.confirm). A decision on the whole step also measures both
variants' peak memory once (rewriter.memory); with ``objective="memory"`` it keeps a rewrite
that lowers the peak within ``memory_slowdown`` (region decisions stay on time). Everything happens inside
:func:`rewriter.state.preserved_state`, so the user's model, optimizer and RNG come out as
they went in, also when a pass raises or the user interrupts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from rewriter import amp, memory, optimizers
from rewriter import plan as plans
from rewriter.advisor import advise
from rewriter.compile_gate import CompileGate
from rewriter.blocks import find_blocks
from rewriter.capture import Capture, DynamoCapture, FxCapture, GraphSlot, capture
from rewriter.regional import RegionalCapture
from rewriter.confirm import Confirmation, KeptUnit, usual_pairs
from rewriter.errors import CaptureError, PlanError
from rewriter.gate import Clock, GateSettings, Step, decide, device_clock, figure, known_verdict, measure
from rewriter.ir import structure_signature
from rewriter.job import VERIFY_SEED, Job, switched
from rewriter.kept import KeptPass, apply_kept, apply_sites, build, mode_of, overlay_for
from rewriter.knowledge import KnowledgeBase, entry_key
from rewriter.optimizer_gate import gate_optimizer
from rewriter.pass_api import Pass, PassContext, registered_passes
from rewriter.profiling import ProfileSettings, compare, profile_run
from rewriter.record import Recorder, Recorded
from rewriter.reference import Reference
from rewriter.region import Region, captured_dtype, dtype_of_region, find_regions
from rewriter.report import Decision, Report
from rewriter.site_gate import REGION_TIMING, held_for_backward, measure_region, original_ms, verify_region
from rewriter.state import preserved_state
from rewriter.verify import Comparison, compare_runs, tolerance_for

log = logging.getLogger("rewriter.progress")

DEFAULT_TIME_BUDGET = 60.0


@dataclass
class Settings:
    """How optimize() measures and decides (the keyword options of optimize())."""

    min_speedup: float = 1.05  # the region margin (and the bar for whole-step decisions)
    front_end: str = "auto"
    gate: GateSettings = field(default_factory=GateSettings)
    clock: Clock | None = None
    profile: bool = True
    plan: Any = None
    replace_optimizer: bool = True  # False when optimize() already handed the optimizer back
    cache_dir: str | None = None  # decision cache: plans by fingerprint
    strict_plan: bool = False  # a plan that does not fit is an error (other ranks follow rank 0)
    time_budget: float | None = DEFAULT_TIME_BUDGET  # seconds for deciding (profiling aside)
    knowledge_base: KnowledgeBase = field(default_factory=lambda: KnowledgeBase(None))
    # the graph compiler as a gated candidate (rewriter.compile_gate): "auto", True, False,
    # an executor name or a torch.compile backend callable
    compile: Any = False
    objective: str = "time"  # "memory": keep what lowers peak memory within memory_slowdown
    memory_slowdown: float = 0.03
    # regional rewriting (rewriter.blocks): "auto", True or False; see rewriter.api.optimize
    regional: Any = "auto"


@dataclass
class Outcome:
    """What the wrapper needs after the run: how to run the optimized model, and the report."""

    report: Report
    capture: Capture | None
    kept: list[KeptPass]
    use_original: bool
    context: PassContext
    optimizer: torch.optim.Optimizer | None = None  # what optimize() returns beside the model
    loss_scale: amp.DynamicLossScale | None = None  # fp16 training: scales gradients from outputs
    compiled: dict | None = None  # the kept compiled form, in OptimizedModel's _compiled layout

    def fall_back_to_original(self, reason: str) -> None:
        """From now on the original model runs (e.g. hooks changed after optimize())."""
        self.use_original = True
        self.report.notes.append(reason)


def run_pipeline(job: Job, passes: list[Pass], settings: Settings) -> Outcome:
    return Run(job, passes, settings).execute()


class Run:
    """One optimize() job: owns the capture, the reference numerics, the state snapshot, the
    kept decisions and the report."""

    def __init__(self, job: Job, passes: list[Pass], settings: Settings) -> None:
        self.job, self.passes, self.settings = job, passes, settings
        self.report = Report(model=type(job.model).__name__, device=job.backend.name, mode=job.mode,
                             dtype=str(job.dtype).replace("torch.", "") if job.dtype else None,
                             objective=settings.objective)
        self.clock = settings.clock or device_clock(job.backend)
        self.ctx = PassContext(job.backend, job.training, job.dtype, objective=settings.objective)
        # peak bytes of one run of a step: a controlled clock injects them in tests
        self.peak_of = getattr(self.clock, "peak_bytes", None) or (
            lambda step: memory.peak_bytes(step.run, job.backend))
        # outputs a drops_outputs pass set to None are not compared (objective="memory" only)
        self.may_drop_outputs = settings.objective == "memory" and any(
            p.drops_outputs for p in passes)
        self.kept: list[KeptPass] = []
        self.units: list[KeptUnit] = []  # each kept decision, for the confirmation's ablation
        self.fused_opt: optimizers.OptimizerCandidate | None = None
        self.cap: Capture | None = None
        self.started = time.perf_counter()
        self.deadline = (self.started + settings.time_budget) if settings.time_budget else None
        self.step_seconds = 0.0
        self.compiled: dict | None = None  # set by CompileGate when the compiled form is kept
        self.compile_plan: dict | None = None

    # --- the flow ----------------------------------------------------------------------------
    def execute(self) -> Outcome:
        try:
            outcome = self._execute()
        except BaseException:
            if isinstance(self.cap, RegionalCapture):
                self.cap.remove()
            raise
        if isinstance(outcome.capture, RegionalCapture):
            self._settle_installation(outcome)
        return outcome

    def _settle_installation(self, outcome: Outcome) -> None:
        """Regional capture: the installed block forwards stay, engaged for every call from now
        on, when a block graph runs rewritten; otherwise they are taken off again."""
        cap: RegionalCapture = outcome.capture  # type: ignore[assignment]
        rows = cap.block_rows()
        for row in rows:  # which kept passes rewrite this block's graphs
            slots = [s for s in cap.slots if s.block == row["class"]]
            row["passes"] = [kp.name for kp in outcome.kept if any(
                (s.overlay is not None) if kp.pass_.sets_precision else
                apply_kept(s.original, kp, self.ctx, s.name) is not None for s in slots)]
        self.report.blocks = rows
        if outcome.use_original or not any(r["rewritten"] for r in rows):
            cap.remove()
        else:
            cap.engage()

    def _execute(self) -> Outcome:
        job = self.job
        use_original = False
        with preserved_state(job.model, job.optimizer, job.backend.rng_states()) as snapshot:
            self.snapshot = snapshot
            with self._phase("reference"):
                t0 = time.perf_counter()
                self.reference = Reference(job, snapshot)
                self.step_seconds = time.perf_counter() - t0
            try:
                with self._phase("capture"):
                    self.cap = self._checked_capture()
            except CaptureError as e:
                return self._capture_failed(e)
            snapshot.restore()
            if isinstance(self.cap, DynamoCapture):
                self.cap.on_new_graph = self._on_new_graph
            fingerprint = self._fingerprint()
            plan = self._plan_to_replay(fingerprint)
            if plan is not None:
                self._replay(plan)
            else:
                self._decide()
                use_original = not self._confirm()
                snapshot.restore()
            if use_original:
                self._drop_all()
            # the graph compiler: one more candidate, on the whole step
            if plan is not None:
                CompileGate(self).replay(plan.get("compile"))
            else:
                CompileGate(self).decide()
            self.settings.knowledge_base.save()
            if self.settings.profile:
                with self._phase("profile"):
                    self._profile()
                snapshot.restore()
            self.report.graphs = len(self.cap.slots)
            # precision passes last: they apply on top of the rest
            order = sorted(self.kept, key=lambda kp: kp.pass_.sets_precision)
            self.report.plan = plans.make_plan(
                fingerprint, [kp.name for kp in order], [d.to_dict() for d in self.report.decisions],
                self.fused_opt.description if self.fused_opt else None,
                kept_sites={kp.name: kp.to_dict() for kp in order}, compile=self.compile_plan)
        if self.settings.cache_dir is not None and plan is None:
            plans.cache_plan(self.settings.cache_dir, fingerprint, self.report.plan)
        return self._outcome()

    def _outcome(self) -> Outcome:
        optimizer = self.job.optimizer
        if self.fused_opt is not None:
            optimizer = self.fused_opt.switch(self.job.optimizer)  # after the snapshot: stays
            self.report.notes.append(f"optimizer: {self.fused_opt.description}")
        loss_scale = self._loss_scaling(optimizer)
        kept = {kp.name for kp in self.kept if kp.pass_.drops_outputs}
        dropped = [d.pass_name for d in self.report.decisions if d.kept and d.pass_name in kept
                   and ("outputs dropped (None)" in d.verification
                        or any("None" in site for site in d.sites))]
        if dropped:
            self.report.notes.append(
                f"objective='memory': {', '.join(dropped)} returns None for outputs the loss alone "
                "needed (a causal LM's logits): the loss and gradients are unchanged; use "
                "objective='time' where the caller reads them")
        self.report.optimize_seconds = time.perf_counter() - self.started
        log.info("rewriter: done in %.1f s: %s", self.report.optimize_seconds,
                 self.report.final.get("reason", ""))
        return Outcome(self.report, self.cap, list(self.kept), not self.kept, self.ctx, optimizer,
                       loss_scale, self.compiled)

    def _capture_failed(self, e: CaptureError) -> Outcome:
        self.report.front_end_reason = str(e)
        self.report.final = {"kept": False, "reason": f"capture failed: {e}"}
        self.report.plan = plans.make_plan({}, [], [])
        log.warning("rewriter: %s; the original model will run", e)
        self.report.optimize_seconds = time.perf_counter() - self.started
        return Outcome(self.report, None, [], True, self.ctx, self.job.optimizer)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            phases = self.report.phases
            phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - t0, 3)

    def _remaining(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def _confirm_reserve(self) -> float:
        """Time kept back for the confirmation: the composed check and the fewest pairs of two
        steps."""
        g = self.settings.gate
        return self.step_seconds * (1 + 2 * usual_pairs(g)) * 1.25

    def _out_of_time(self) -> bool:
        return self._remaining() < self._confirm_reserve()

    # --- deciding ----------------------------------------------------------------------------
    def _decide(self) -> None:
        """Every pass in order; with ``dtype=``, in the precision it will run in.

        The precision pass (cast_to_half) changes what every other rewrite is measured in, and
        its own worth depends on them (a half-precision GEMM on a transposed operand can be far
        slower than the fused kernel that replaces it), so the others are decided with it
        applied on top, speculatively; then it is decided itself on the whole step, with the
        kept rewrites in. When it is rejected, the others are decided again at full precision.
        """
        precision = [p for p in self.passes if p.sets_precision]
        others = [p for p in self.passes if not p.sets_precision]
        speculate = [p for p in precision if p.applies_to(self.ctx) is None][:1]
        if speculate:
            self._set_overlay([KeptPass(speculate[0])])
        self._decide_each(others)
        if speculate:
            self._set_overlay([])
        self._decide_each(precision)
        if speculate and not any(kp.pass_.sets_precision for kp in self.kept) \
                and any(d.regions or d.kept for d in self.report.decisions if d.pass_name in
                        {p.name for p in others}):
            log.info("rewriter: %s was not kept: deciding the other passes again at full precision",
                     speculate[0].name)
            redo = {p.name for p in others}
            self.report.decisions = [d for d in self.report.decisions if d.pass_name not in redo]
            self.units = [u for u in self.units if u.pass_name not in redo]
            self.rebuild([])
            self._decide_each(others)
            self.report.notes.append(f"{speculate[0].name} was not kept, so the other passes were "
                                     "decided again at full precision")
        if self.job.optimizer is not None:
            self._decide_optimizer()

    def _set_overlay(self, kept: list[KeptPass]) -> None:
        overlay = overlay_for(kept, self.ctx)
        self._speculative = bool(kept)
        for slot in self.cap.slots:
            slot.set_overlay(overlay)

    def _decide_each(self, passes: list[Pass]) -> None:
        for i, p in enumerate(passes, 1):
            d = self._try(p)  # finding sites is cheap; measuring them checks the budget
            self.snapshot.restore()
            self.report.decisions.append(d)
            log.info("rewriter: [%d/%d] %s: %s: %s", i, len(passes), p.name, d.status, d.reason)

    def _decide_optimizer(self) -> None:
        if self._out_of_time():
            d = Decision("fuse_optimizer", False, "not reached",
                         f"the time budget ({self.settings.time_budget:g} s) ran out first", scope="step")
        else:
            with self._phase("measure"):
                d, self.fused_opt = gate_optimizer(
                    self.job, self.clock, self.settings.gate, self.settings.min_speedup,
                    self.settings.replace_optimizer, self.deadline, self.settings.knowledge_base)
            self.snapshot.restore()
            if self.fused_opt is not None:
                self.units.append(KeptUnit("fuse_optimizer", None, d.speedup, d.noise,
                                           _saved(d.measurement), 1))
        self.report.decisions.append(d)
        log.info("rewriter: optimizer: %s: %s", d.status, d.reason)

    def _site_descriptions(self, sites: dict[str, list]) -> list[str]:
        """One line per site in the model. A block's graphs serve all its instances: their sites
        are listed once per instance (from the block graph with the most, as the graphs of one
        block are its signatures, e.g. a checkpoint's recompute, not more sites)."""
        slots = {s.name: s for s in self.cap.slots}
        out: list[str] = []
        per_block: dict[str, list[str]] = {}
        for name, found in sites.items():
            descs = [s.description for s in found]
            block = slots[name].block
            if block is None:
                out += descs
            elif len(descs) > len(per_block.get(block, [])):
                per_block[block] = descs
        instances = {b.name: len(b.instances) for b in getattr(self.cap, "blocks", [])}
        for block, descs in per_block.items():
            out += [f"{d} (in each {block})" for d in descs] * instances.get(block, 1)
        return out

    def _try(self, p: Pass) -> Decision:
        why_not = p.applies_to(self.ctx)
        if why_not:
            return Decision(p.name, False, "not applicable", why_not, scope=p.scope)
        cap = self.cap
        self.ctx.declined.clear()  # sites the pass matches but declines record why here
        try:
            with self._phase("rewrite"):  # finding the sites, building the candidate graphs
                sites = {slot.name: slot.try_pass(p, self.ctx) for slot in cap.slots}
        except Exception as e:
            self._reject_all()
            return Decision(p.name, False, "raised", f"{type(e).__name__}: {e}", scope=p.scope)
        descriptions = self._site_descriptions(sites)
        if not descriptions:
            self._reject_all()
            return Decision(p.name, False, "no sites", "; ".join(self.ctx.declined) or "no site matched",
                            scope=p.scope)
        log.info("rewriter: %s: %d site(s)", p.name, len(descriptions))
        if p.scope == "site":
            with self._phase("rewrite"):
                regions, why = self._regions(p, sites)
            if regions is not None:
                return self._try_on_regions(p, regions, descriptions)
            return self._try_on_step(p, descriptions, note=f"measured on the whole step: {why}")
        return self._try_on_step(p, descriptions)

    def _regions(self, p: Pass, sites: dict[str, list]) -> tuple[list[tuple[GraphSlot, Region]] | None, str]:
        found: list[tuple[GraphSlot, Region]] = []
        for slot in self.cap.slots:
            if slot.candidate is None:
                continue
            regions = find_regions(slot.kept, slot.candidate, sites[slot.name], p.name, slot.name)
            if isinstance(regions, str):
                return None, f"its change is not local ({regions})"
            found += [(slot, r) for r in regions]
        return (found, "") if found else (None, "no region")

    # --- a pass decided per region signature ---------------------------------------------------
    def _try_on_regions(self, p: Pass, regions: list[tuple[GraphSlot, Region]],
                        descriptions: list[str]) -> Decision:
        device, mode, precision = self.job.backend.name, mode_of(self.ctx), self._precision()
        groups: dict[str, list[tuple[GraphSlot, Region]]] = defaultdict(list)
        for slot, r in regions:
            groups[r.signature(device, mode, p.version, precision)].append((slot, r))
        keys = {sig: self._region_key(p, members[0][1], precision) for sig, members in groups.items()}
        known = {sig: self._known_row(keys[sig], _calls(members)) for sig, members in groups.items()}
        # A signature the knowledge base rejects is not run at all: recording its boundary
        # values and verifying it would only decide what is already decided (a kept one is
        # still verified on this model's values). Under the memory objective in training
        # (_held_decides) what it holds may keep what time rejects, so none is settled unrun.
        # Of the others, only the sites a signature is verified on (the first of them is also
        # the one measured) are recorded: what one recording holds stays VERIFY_SAMPLE regions
        # a signature at any depth.
        settled = {} if self._held_decides() else {
            sig: self._unrun_row(sig, members, precision, k) for sig, members in groups.items()
            if (k := known[sig]) is not None and not k["kept"]}
        to_run = [(slot, r) for sig, members in groups.items() if sig not in settled
                  for slot, r in _verify_sample(members)]
        values: dict[str, dict[str, Recorded]] = {}
        if to_run:
            with self._phase("record"):
                recorded = self._record(to_run)
            if recorded is None:
                return self._try_on_step(p, descriptions, note="measured on the whole step: a "
                                         "graph was not run in the recording run")
            values = recorded
        precise = self.kept + ([KeptPass(q) for q in self.passes if q.sets_precision]
                               if getattr(self, "_speculative", False) else [])
        overlay = overlay_for(precise, dataclasses.replace(self.ctx, region=True))
        kept_sigs, rows, kept_structures, rejected_structures, rejected = set(), [], set(), set(), set()
        worst_err: float | None = None  # None: no region of it verified (none run, or all failed)
        for sig, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            row = settled.get(sig) or self._decide_signature(p, sig, members, values, overlay,
                                                             keys[sig], known[sig])
            if self._held_decides():
                row = self._by_held_memory(row, members, values, overlay)
            rows.append(row)
            if row.get("max_abs_error") is not None:
                worst_err = max(worst_err or 0.0, row["max_abs_error"])
            structure = members[0][1].structure_key
            if row["kept"]:
                kept_sigs.add(sig)
                kept_structures.add(structure)
                self.units.append(KeptUnit(p.name, sig, row.get("speedup"), row.get("noise"),
                                           row.get("saved_ms_per_step"), _calls(members)))
            else:
                rejected_structures.add(structure)
                rejected.add(sig)
        self._keep_regions(p, regions, kept_sigs, device, mode, precision)
        if kept_sigs:
            self.kept.append(KeptPass(p, kept_sigs, kept_structures,
                                      rejected_structures - kept_structures, rejected, precision))
        lead = rows[0]
        statuses = {r["status"] for r in rows}
        status = "kept" if kept_sigs else (statuses.pop() if len(statuses) == 1 else "rejected")
        kept_sites = sum(r["sites"] for r in rows if r["kept"])
        reason = (f"{len(kept_sigs)} of {len(rows)} signature(s) kept ({kept_sites} of "
                  f"{_calls(regions)} sites); " if len(rows) > 1 else "") + \
            f"region, {lead['sites']} site(s): {lead['reason']}"
        return Decision(p.name, bool(kept_sigs), status, reason, speedup=lead.get("speedup"),
                        noise=lead.get("noise"), max_abs_error=worst_err,
                        sites=descriptions, measurement=lead.get("measurement"),
                        verification=lead.get("verification", ""), scope="site", regions=rows,
                        objective="memory" if any(r.get("objective") == "memory" for r in rows)
                        else "time")

    def _held_decides(self) -> bool:
        """Regions are judged on what they hold for backward too: objective="memory", training.
        (In inference nothing is held between layers; regions are decided on time.)"""
        return self.settings.objective == "memory" and self.job.training

    def _by_held_memory(self, row: dict, members: list[tuple[GraphSlot, Region]],
                        values: dict[str, dict[str, Recorded]], overlay: Any) -> dict:
        """A decided signature under objective="memory" (rewriter.memory.decide_held): the
        bytes its first site holds for backward without and with the rewrite, then the
        verdict. Rows not decided on their figures (failed verification, not reached) stay."""
        if row.get("status") not in ("kept", "rejected"):
            return row
        slot, r = members[0]
        try:
            with self._phase("memory"):
                before, after = held_for_backward(r, self._values(values, slot, r), self._forms(r, overlay))
        except Exception as e:  # noqa: BLE001 (a measurement problem must not cost the decision)
            log.info("rewriter: %s: memory held for backward not measured: %s: %s", r.label,
                     type(e).__name__, e)
            return row
        figures = row.get("measurement") or {}
        usable = (not figures.get("busy") and not figures.get("out_of_time")
                  and figures.get("pairs", 0) >= 2)
        keep, reason, by = memory.decide_held(
            bool(row["kept"]), row["reason"], row.get("speedup") if usable else None, before, after,
            _calls(members), self._memory_floor, self.settings.memory_slowdown)
        return {**row, "kept": keep, "status": "kept" if keep else "rejected", "reason": reason,
                "objective": by, "held_bytes_before": before, "held_bytes_after": after}

    @functools.cached_property
    def _memory_floor(self) -> int:
        """The fewest bytes a region pass must change what is held, over all its sites, to
        count: a share (MIN_MEMORY_SAVING) of the model's parameters, which the step's peak
        always exceeds (weights, and in training their gradients too)."""
        params = sum(t.numel() * t.element_size() for t in self.job.model.parameters())
        return int(memory.MIN_MEMORY_SAVING * params)

    def _precision(self) -> str | None:
        """The dtype a kept (or speculatively applied) precision pass runs everything in
        (None: as captured)."""
        speculative = getattr(self, "_speculative", False)
        if (speculative or any(kp.pass_.sets_precision for kp in self.kept)) and self.job.dtype is not None:
            return str(self.job.dtype).replace("torch.", "")
        return None

    def _decide_signature(self, p: Pass, sig: str, members: list[tuple[GraphSlot, Region]],
                          values: dict[str, dict[str, Recorded]], overlay: Any, key: str,
                          known: dict | None) -> dict:
        """Verify a sample of the signature's sites, then decide it: from ``known`` (its
        knowledge-base row, :meth:`_known_row`) when there is one, else by measuring (and
        store the figures under ``key``)."""
        first = members[0][1]
        first_values = self._values(values, members[0][0], first)
        row = _row_head(sig, members, dtype_of_region([v.value for v in first_values]))
        with self._phase("verify"):
            worst = Comparison(True)
            sample = _verify_sample(members)
            for slot, r in sample:
                c = verify_region(r, self._values(values, slot, r), self.job.training,
                                  self._forms(r, overlay))
                if not c.ok and not self._whole_model_agrees(p):
                    row.update(status="failed verification", max_abs_error=None,
                               reason=f"at {r.label}: {c.problem}")
                    return row
                if not c.ok:
                    # A boundary gradient the model's own Jacobian hides (a different
                    # subgradient at a kink, where the upstream op passes zero): the whole
                    # model with the rewrite in agrees with the original.
                    c = Comparison(True, self._agrees_for[2], note=f"at the region boundary "
                                   f"beyond the bound ({c.problem}), but the whole model agrees")
                if c.max_abs_error >= worst.max_abs_error:
                    worst = c
        checked = len(sample)
        row.update(max_abs_error=worst.max_abs_error, verified_sites=checked,
                   verification=worst.describe() + (f" ({checked} of {len(members)} sites checked; "
                                                    "the composed model is verified whole)"
                                                    if checked < len(members) else ""))
        if known is not None:
            row.update(known)
            return row
        if self._out_of_time():
            row.update(status="not reached", reason="the time budget ran out before measuring it")
            return row
        slot, r = members[0]
        too_small, once_ms = self._too_small_to_measure(r, self._values(values, slot, r), overlay,
                                                        _calls(members))
        if too_small:
            row.update(status="rejected", source="measured", reason=too_small,
                       region_ms_before=once_ms)
            # only the original's time: load only ever slows a sample, so no busy machine makes
            # a region look negligible; whether it is, each run judges against its own step
            self.settings.knowledge_base.put(key, {"original_ms": once_ms, "pass": p.name,
                                                   "example": first.label, "ran_in": row["ran_in"]})
            return row
        with self._phase("measure"):
            m = measure_region(r, self._values(values, slot, r), self.job.training, clock=self.clock,
                               settings=self.settings.gate, min_speedup=self.settings.min_speedup,
                               forms=self._forms(r, overlay), deadline=self.deadline,
                               original_seconds=None if once_ms is None else once_ms / 1e3)
        keep, reason = decide(m, self.settings.min_speedup, self.settings.gate.noise_widths)
        keep, reason = self._negligible(keep, reason, m.saved_ms * _calls(members))
        figures = m.to_dict()  # finite figures or None (no pair: a warm-up the budget cut short)
        saved = _saved(figures)
        row.update(kept=keep, status="kept" if keep else "rejected", source="measured",
                   reason=reason, speedup=figures["speedup"], noise=figures["noise"],
                   measurement=figures, region_ms_before=figures["baseline_ms"],
                   region_ms_after=figures["candidate_ms"],
                   saved_ms_per_step=None if saved is None else saved * _calls(members))
        if m.storable(self.settings.gate.min_pairs):
            self.settings.knowledge_base.put(key, {**figures, "pass": p.name, "example": first.label,
                                                   "ran_in": row["ran_in"]})
        return row

    def _region_key(self, p: Pass, r: Region, precision: str | None) -> str:
        return entry_key(r.signature_text(self.job.backend.name, mode_of(self.ctx), p.version,
                                          precision),
                         {**self.job.backend.knowledge_key(), "region timing": REGION_TIMING})

    def _known_row(self, key: str, sites: int) -> dict | None:
        """The knowledge base's figures for a signature, judged under today's margin, as the
        fields of its report row (None: not in the knowledge base)."""
        known = self.settings.knowledge_base.get(key)
        if known is None:
            return None
        if "original_ms" in known:  # a region found negligible: the original's time alone
            reason = self._negligible_original(known["original_ms"], sites)
            return dict(kept=False, status="rejected", source="knowledge base", measurement=known,
                        reason=f"{reason} (knowledge base, measured {known.get('recorded', '')})",
                        region_ms_before=known["original_ms"]) if reason else None
        keep, reason = known_verdict(known, self.settings.min_speedup, self.settings.gate.noise_widths)
        saved = (known["baseline_ms"] - known["candidate_ms"]) * sites
        keep, reason = self._negligible(keep, reason, saved)
        return dict(kept=keep, status="kept" if keep else "rejected", source="knowledge base",
                    reason=reason, speedup=known["speedup"], noise=known["noise"], measurement=known,
                    region_ms_before=known["baseline_ms"], region_ms_after=known["candidate_ms"],
                    saved_ms_per_step=saved)

    @staticmethod
    def _unrun_row(sig: str, members: list[tuple[GraphSlot, Region]], precision: str | None,
                   known: dict) -> dict:
        """The whole report row of a signature decided by ``known`` (its knowledge-base row)
        without running it: no values recorded, nothing verified."""
        first = members[0][1]
        ran_in = known["measurement"].get("ran_in") or precision or captured_dtype(first.before)
        return {**_row_head(sig, members, ran_in), "max_abs_error": None,
                "verification": "not run: rejected on its knowledge-base figures", **known}

    def _whole_model_agrees(self, p: Pass) -> bool:
        """The model with every site of ``p`` in (the slots' candidates) against the original;
        computed once per pass."""
        if getattr(self, "_agrees_for", (None,))[0] is not p:
            ok, _, err = self._verify_candidate()
            self._agrees_for = (p, ok, err or 0.0)
        return self._agrees_for[1]

    def _negligible(self, keep: bool, reason: str, saved_ms: float) -> tuple[bool, str]:
        """A region too small to matter (a few microseconds of index arithmetic) is not kept:
        its measurement is mostly call overhead, and its saving is lost in any step."""
        step_ms = 1e3 * self.step_seconds
        if keep and step_ms > 0 and saved_ms < self.settings.gate.negligible * step_ms:
            return False, (f"negligible: saves {saved_ms:.4f} ms of a ~{step_ms:.0f} ms step "
                           f"(under {100 * self.settings.gate.negligible:g}%); {reason}")
        return keep, reason

    def _too_small_to_measure(self, r: Region, values: list[Recorded], overlay: Any,
                              sites: int) -> tuple[str, float | None]:
        """Why the region is not worth an A/B comparison ("" when it is): the original itself,
        at every site, takes less than a negligible share of the step, so no replacement could
        save what the gate would keep. With it, one call of the original in ms (None when the
        check is off), which the comparison then need not time again."""
        step_ms = 1e3 * self.step_seconds
        if step_ms <= 0 or self.settings.gate.negligible <= 0:
            return "", None
        with self._phase("measure"):
            once = original_ms(r, values, self.job.training, clock=self.clock,
                               forms=self._forms(r, overlay))
        return self._negligible_original(once, sites), once

    def _negligible_original(self, once_ms: float, sites: int) -> str:
        """Why a region whose original takes ``once_ms`` a call is not worth comparing ("" when
        it is): at all its sites it is under the negligible share of this run's step."""
        step_ms, share = 1e3 * self.step_seconds, self.settings.gate.negligible
        if step_ms <= 0 or share <= 0 or once_ms * sites >= share * step_ms:
            return ""
        return (f"negligible: the original region takes {once_ms:.4f} ms a call, "
                f"{once_ms * sites:.4f} ms at its {sites} site(s) of a ~{step_ms:.0f} ms step (under "
                f"{100 * share:g}%): not measured against its replacement")

    @staticmethod
    def _values(values: dict[str, dict[str, Recorded]], slot: GraphSlot, r: Region) -> list[Recorded]:
        return [values[slot.name][name] for name in r.inputs]

    @staticmethod
    def _forms(r: Region, overlay: Any) -> tuple[Any, Any] | None:
        return (overlay(r.before), overlay(r.after)) if overlay is not None else None

    def _record(self, regions: list[tuple[GraphSlot, Region]]) -> dict[str, dict[str, Recorded]] | None:
        """One run of the model as it now runs, recording the boundary values of ``regions``
        (None when a graph one of them is in did not run)."""
        names: dict[str, set[str]] = defaultdict(set)
        for slot, r in regions:
            names[slot.name].update(r.inputs)
        recorders = {}
        for slot in self.cap.slots:
            if slot.name in names:
                slot.recorder = recorders[slot.name] = Recorder(names[slot.name])
        try:
            torch.manual_seed(VERIFY_SEED)
            grad = torch.enable_grad() if self.job.training else torch.no_grad()
            with switched(self.cap.switch, deterministic=True), grad:
                self.cap(*self.job.args, **self.job.kwargs)
        finally:
            for slot in self.cap.slots:
                slot.recorder = None
            self.job.zero_grads()
            self.snapshot.restore()
        values = {name: rec.values for name, rec in recorders.items()}
        for slot, r in regions:
            if any(n not in values[slot.name] for n in r.inputs):
                return None
        return values

    def _keep_regions(self, p: Pass, regions: list[tuple[GraphSlot, Region]], kept_sigs: set[str],
                      device: str, mode: str, precision: str | None) -> None:
        for slot in self.cap.slots:
            mine = [r for s, r in regions if s is slot]
            chosen = [r for r in mine if r.signature(device, mode, p.version, precision) in kept_sigs]
            if mine and len(chosen) == len(mine):
                slot.accept()
            elif chosen:
                new = apply_sites(slot.kept, p, self.ctx, {a for r in chosen for a in r.anchors})
                slot.set_kept(new) if new is not None else slot.reject()
            else:
                slot.reject()

    # --- a pass decided on the whole step ------------------------------------------------------
    def _try_on_step(self, p: Pass, descriptions: list[str], note: str = "") -> Decision:
        if self._out_of_time():
            self._reject_all()
            return Decision(p.name, False, "not reached", f"{len(descriptions)} site(s) found; the "
                            f"time budget ({self.settings.time_budget:g} s) ran out before measuring",
                            sites=descriptions, scope="step")
        with self._phase("verify"):
            ok, detail, err = self._verify_candidate()
        if not ok:
            self._reject_all()
            return Decision(p.name, False, "failed verification", detail, max_abs_error=err,
                            sites=descriptions, scope="step")
        base = tuple(k.name for k in self.kept)
        # time decisions on the whole step are stored too (memory ones measure peaks each run)
        key = self._step_key(p) if self.settings.objective == "time" else None
        known = self.settings.knowledge_base.get(key) if key else None
        if known is not None:
            keep, reason = known_verdict(known, self.settings.min_speedup,
                                         self.settings.gate.noise_widths)
            speedup, noise, figures, decided_by = known["speedup"], known["noise"], known, "time"
            saved = _saved(known)
            peaks: tuple[int | None, int | None] = (None, None)
        else:
            with self._phase("measure"):
                m = measure(self._variant_step(False, base, "kept"),
                            self._variant_step(True, base + (p.name,), "candidate"),
                            clock=self.clock, settings=self.settings.gate,
                            min_speedup=self.settings.min_speedup, deadline=self.deadline)
            keep, reason = decide(m, self.settings.min_speedup, self.settings.gate.noise_widths)
            peaks = self._peaks(self._variant_step(False, base, "kept"),
                                self._variant_step(True, base + (p.name,), "candidate"), m)
            keep, reason, decided_by = self._by_objective(m, keep, reason, peaks)
            figures = m.to_dict()  # finite figures or None (no pair: a cut-short warm-up)
            speedup, noise, saved = figures["speedup"], figures["noise"], m.saved_ms
            if key and m.storable(self.settings.gate.min_pairs):
                self.settings.knowledge_base.put(key, {**figures, "pass": p.name, "example": "whole step"})
        if keep:
            kp = KeptPass(p)
            self.kept.append(kp)
            self.units.append(KeptUnit(p.name, None, speedup, noise, saved, 1))
            if p.sets_precision:  # applied on top of everything measured from now on
                overlay = overlay_for([kp], self.ctx)
                for slot in self.cap.slots:
                    slot.reject()
                    slot.set_overlay(overlay)
            else:
                for slot in self.cap.slots:
                    slot.accept()
        else:
            self._reject_all()
        return Decision(p.name, keep, "kept" if keep else "rejected",
                        (f"{note}; " if note else "whole step: ") + reason, speedup=speedup,
                        noise=noise, max_abs_error=err, sites=descriptions,
                        measurement=figures, verification=detail, scope="step",
                        objective=decided_by, peak_mb_before=memory.mb(peaks[0]),
                        peak_mb_after=memory.mb(peaks[1]))

    def _step_key(self, p: Pass) -> str:
        """The knowledge-base key of a whole-step decision: the pass against exactly this step
        (the graphs as kept and with the candidate, the model's tensor shapes, the inputs, the
        optimizer, device, mode, precision, versions)."""
        return self._step_entry_key({
            "scope": "step", "pass": p.name, "version": p.version,
            "kept": [kp.name for kp in self.kept],
            "overlay": any(slot.overlay is not None for slot in self.cap.slots),
            "graphs": plans.graph_hash(structure_signature(s.kept) for s in self.cap.slots),
            "candidate": plans.graph_hash(structure_signature(s.candidate or s.kept)
                                          for s in self.cap.slots)})

    def confirmation_key(self) -> str:
        """The knowledge-base key of the step check: the original against exactly this composed
        step (the graphs as they run, with the precision overlay; the fused optimizer)."""
        return self._step_entry_key({
            "scope": "confirm", "versions": {kp.name: kp.pass_.version for kp in self.kept},
            "original": plans.graph_hash(structure_signature(s.original) for s in self.cap.slots),
            "composed": plans.graph_hash(structure_signature(s.kept_run) for s in self.cap.slots),
            "fused_optimizer": self.fused_opt.description if self.fused_opt else None})

    def _step_entry_key(self, what: dict) -> str:
        """``what`` on this step: device, mode, precision, the model's tensor shapes, the
        inputs, the optimizer, the software versions and the machine."""
        job = self.job
        tensors = [[n, list(t.shape), str(t.dtype)] for n, t in
                   list(job.model.named_parameters()) + list(job.model.named_buffers())]
        text = json.dumps({
            **what, "device": job.backend.name, "mode": mode_of(self.ctx),
            "dtype": str(job.dtype) if job.dtype else None,
            "tensors": hashlib.sha256(json.dumps(tensors).encode()).hexdigest()[:16],
            "inputs": plans.input_signature(job.args, job.kwargs),
            "optimizer": type(job.optimizer).__name__ if job.optimizer is not None else None},
            sort_keys=True)
        return entry_key(text, job.step_knowledge_key())

    # --- memory --------------------------------------------------------------------------------
    def _peaks(self, before: Step, after: Step, m: Any) -> tuple[int | None, int | None]:
        """Peak bytes of one run of each variant, after their timed runs (so both are warm);
        not measured for a comparison that ran out of time or found the machine busy."""
        if m.out_of_time or m.busy:
            return None, None
        try:
            with self._phase("memory"):
                peaks = self.peak_of(before), self.peak_of(after)
        except Exception as e:  # a profiler problem must not cost the decision
            log.info("rewriter: peak memory not measured: %s: %s", type(e).__name__, e)
            peaks = None, None
        finally:
            self.snapshot.restore()
        return peaks

    def _by_objective(self, m: Any, keep: bool, reason: str,
                      peaks: tuple[int | None, int | None]) -> tuple[bool, str, str]:
        """(keep, reason, the objective that decided). "time": the time verdict as it is.
        "memory": kept when it lowers the peak within ``memory_slowdown``; a faster rewrite
        is kept on time unless it raises the peak."""
        before, after = peaks
        if self.settings.objective == "time":
            return keep, reason, "time"
        mem_keep, mem_reason = memory.decide_memory(m, before, after, self.settings.memory_slowdown,
                                                    figure(m) if m.pairs else "")
        if mem_keep:
            return True, mem_reason, "memory"
        if keep and before is not None and after is not None \
                and after > before * (1 + memory.MIN_MEMORY_SAVING):
            return False, (f"raises peak memory ({before / 2**20:.2f} MB -> {after / 2**20:.2f} MB) "
                           f"although {reason}"), "memory"
        if keep:
            return True, reason, "time"
        return False, f"{mem_reason}; on time: {reason}", "memory"

    def _variant_step(self, candidate: bool, passes: tuple[str, ...], label: str) -> Step:
        inner = self.job.step(self.cap)

        def run() -> None:
            with switched(self.cap.switch, use_candidate=candidate):
                inner()
        return Step(run, passes, label)

    def _reject_all(self) -> None:
        for slot in self.cap.slots:
            slot.reject()

    def _verify_candidate(self, composed: bool = False) -> tuple[bool, str, float | None]:
        """The whole model with the candidate in (or, ``composed``, as it now runs) against the
        original's numerics, with the yardstick where the bound is exceeded."""
        try:
            with switched(self.cap.switch, use_candidate=not composed, deterministic=True):
                got = self.job.numerics(self.cap, deterministic=contextlib.nullcontext())
        except Exception as e:
            return False, f"candidate raised when run: {type(e).__name__}: {e}", None
        finally:
            self.snapshot.restore()
        tol = tolerance_for(self.job.dtype)
        want, dropped = self.reference.values, ""
        if self.may_drop_outputs:
            gone = [k for k in want if k.startswith("output ") and k not in got]
            want = {k: v for k, v in want.items() if k not in gone}
            dropped = f"; outputs dropped (None) under objective='memory': {gone}" if gone else ""
        c = compare_runs(got, want, tol)
        if not c.ok:
            y = self.reference.yardstick()
            if y is not None and composed:
                # Each rewrite was held to the yardstick on its own region; several correct
                # rewrites composed add their rounding, a wrong one is off by far more.
                y = dataclasses.replace(y, factor=2 * y.factor)
            c = compare_runs(got, want, tol, yardstick=y)
        return c.ok, c.describe() + dropped, c.max_abs_error

    # --- the composed model ------------------------------------------------------------------
    def rebuild(self, kept: list[KeptPass]) -> None:
        """Every slot from its original with ``kept`` applied (after an ablation)."""
        self.kept = kept
        overlay = overlay_for(kept, self.ctx)
        for slot in self.cap.slots:
            slot.set_overlay(None)
            slot.set_kept(build(slot.original, kept, self.ctx, slot.name))
            slot.set_overlay(overlay)

    def composed_step(self) -> Step:
        names = tuple(kp.name for kp in self.kept) + (("fuse_optimizer",) if self.fused_opt else ())
        twin = self.fused_opt.twin(self.job.optimizer) if self.fused_opt is not None else None
        optimized = self.job.step(self.cap if self.kept else self.job.model, optimizer=twin)

        def run() -> None:
            with switched(self.cap.switch, use_candidate=False):
                optimized()
        return Step(run, names, "optimized")

    def original_step(self) -> Step:
        return Step(self.job.step(self.job.model), (), "original")

    def _confirm(self) -> bool:
        """Verify the composed model once, then time it once against the original.
        Returns True when the optimized model is what runs."""
        if not self.kept and self.fused_opt is None:
            self.report.final = {"kept": False, "reason": "no rewrite was kept"}
            return False
        with self._phase("confirm"):
            return Confirmation(self).run()

    def _drop_all(self) -> None:
        self.kept, self.fused_opt = [], None
        for slot in self.cap.slots:
            slot.set_overlay(None)
            slot.set_kept(slot.original)

    def _on_new_graph(self, slot: GraphSlot) -> None:
        replay_on_slot(slot, self.kept, self.ctx)

    # --- capture -----------------------------------------------------------------------------
    def _checked_capture(self) -> Capture:
        """Capture, and check the captured model computes what the model does (else fall back)."""
        job, front_end = self.job, self.settings.front_end
        log.info("rewriter: capturing %s (%s step)", type(job.model).__name__, job.mode)
        cap = self._regional_capture()
        if cap is not None:
            problem = self._capture_mismatch(cap)
            if problem:
                cap.remove()
                log.info("rewriter: the regional capture differs from the model (%s); capturing "
                         "the whole model", problem)
                self.report.notes.append(f"regional capture differs from the model ({problem}): "
                                         "the whole model was captured instead")
                cap = None
        if cap is None:
            cap = capture(job.model, job.args, job.kwargs, front_end)
        if isinstance(cap, FxCapture):
            cap.restore_output_type(job.output_type)
        problem = self._capture_mismatch(cap)
        if problem and cap.front_end == "fx" and front_end == "auto":
            cap = DynamoCapture(job.model, f"symbolic_trace graph differs from the model ({problem})")
            problem = self._capture_mismatch(cap)
        if problem:
            raise CaptureError(f"{cap.front_end} capture differs from the model: {problem}")
        if not cap.slots:
            raise CaptureError("Dynamo handed over no graph (torch._dynamo's recompile limit "
                               "reached, or nothing in forward is capturable)")
        if isinstance(cap, DynamoCapture):
            self._require_stable_graphs(cap)
        self.report.front_end, self.report.front_end_reason = cap.front_end, cap.reason
        self.report.left_as_modules = sorted(set(cap.left_as_modules))
        log.info("rewriter: front-end %s (%s), %d graph(s)", cap.front_end, cap.reason, len(cap.slots))
        return cap

    def _regional_capture(self) -> RegionalCapture | None:
        """The regional capture when it is asked for, or chosen ("auto": the model has repeated
        blocks and does not trace whole with symbolic_trace, or says which are its blocks, as
        transformers models do with ``_no_split_modules``); None otherwise."""
        regional, model = self.settings.regional, self.job.model
        if regional is False or self.settings.front_end == "fx":
            return None
        blocks = find_blocks(model)
        if not blocks:
            if regional is True:
                self.report.notes.append("regional=True, but the model has no repeated block: "
                                         "the whole model was captured")
            return None
        names = ", ".join(f"{b.name} x{len(b.instances)}" for b in blocks)
        if regional is True:
            why = f"regional=True: blocks {names}"
        elif getattr(model, "_no_split_modules", None):
            why = f"blocks {names} (the model's _no_split_modules)"
        else:
            try:
                torch.fx.symbolic_trace(model)
                return None  # traces whole: the fx front-end's readable graph
            except Exception:
                why = f"blocks {names}; symbolic_trace does not capture the whole model"
        return RegionalCapture(model, why, blocks)

    def _require_stable_graphs(self, cap: DynamoCapture) -> None:
        """A second call on the same inputs must reuse the graphs. If Dynamo compiles again, its
        guards read Python state that changes per call (a hook counting calls, a step counter
        attribute): past its recompile limit it runs the model eagerly, and every rewrite would
        be kept on paper but never run."""
        before = len(cap.slots)
        grad = torch.enable_grad() if self.job.training else torch.no_grad()  # as Dynamo saw it
        with switched(cap.switch, deterministic=True), grad:
            cap(*self.job.args, **self.job.kwargs)  # forward only: guards are checked there
        self.snapshot.restore()
        if len(cap.slots) > before:
            raise CaptureError("Dynamo recompiles the model at every call (its guards read Python "
                               "state that changes per call, such as a hook that counts calls or a "
                               "step counter attribute), so a rewrite could not stay in effect")

    def _capture_mismatch(self, cap: Capture) -> str:
        """The captured graphs against the model. Plain fp32 rounding (GEMMs blocked another
        way) is not a mismatch: beyond the bound, a float64 run of the model judges."""
        counting = cap.counting_calls() if isinstance(cap, RegionalCapture) else contextlib.nullcontext()
        try:
            with switched(cap.switch, deterministic=True), counting:
                got = self.job.numerics(cap, deterministic=contextlib.nullcontext())
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            self.snapshot.restore()
        tol = tolerance_for(torch.float32)
        c = compare_runs(got, self.reference.values, tol)
        if not c.ok:
            c = compare_runs(got, self.reference.values, tol, yardstick=self.reference.float64())
        return "" if c.ok else c.problem

    # --- plans -------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        job = self.job
        fp = {"device": job.backend.name, "versions": job.backend.versions(),
              "machine": job.backend.machine(), "mode": job.mode,
              "dtype": str(job.dtype) if job.dtype else None,
              "inputs": plans.input_signature(job.args, job.kwargs), "front_end": self.cap.front_end,
              "graphs": plans.graph_hash(structure_signature(s.original) for s in self.cap.slots),
              "pass_versions": {p.name: p.version for p in self.passes}}
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

    # --- after deciding ----------------------------------------------------------------------
    def _profile(self) -> None:
        """One warm-up and one active step: the report's view, not a measurement."""
        job, report = self.job, self.report
        optimized = bool(self.kept) or self.fused_opt is not None or self.compiled is not None
        twin = self.fused_opt.twin(job.optimizer) if self.fused_opt is not None else None
        try:
            before = profile_run(job.step(job.model), job.backend, settings=REPORT_PROFILE, label="original")
            report.top_ops_before, report.findings_before = before.top(10), advise(before)
            report.attach_profiles(original=before)
            if optimized:
                run = self.cap if self.kept else job.model
                if self.compiled is not None:
                    run = self.compiled.get("dynamo") or self.compiled.get("original") or run
                after = profile_run(job.step(run, optimizer=twin), job.backend,
                                    settings=REPORT_PROFILE, label="optimized")
                report.top_ops_after, report.findings_after = after.top(10), advise(after)
                report.op_comparison = compare(before, after, labels=("original", "optimized"))
                report.attach_profiles(original=before, optimized=after)
            if self.settings.objective == "memory":
                self._memory_view(twin if optimized else None, optimized)
        except Exception as e:  # a profiler problem must not cost the user the optimization
            report.notes.append(f"profiling failed: {type(e).__name__}: {e}")

    def _memory_view(self, twin: Any, optimized: bool) -> None:
        """Live memory over one step before and after (the report's memory view)."""
        job = self.job
        steps = {"before": job.step(job.model)}
        if optimized:
            steps["after"] = job.step(self.cap if self.kept else job.model, optimizer=twin)
        for label, step in steps.items():
            step()  # warm: the first run allocates caches
            t = memory.memory_timeline(step, job.backend)
            self.snapshot.restore()
            if t is not None:
                self.report.memory[label] = t.to_dict()

    def _loss_scaling(self, optimizer: torch.optim.Optimizer | None) -> amp.DynamicLossScale | None:
        """fp16 training with half-precision GEMMs kept: dynamic loss scaling, the loop unchanged."""
        job, report = self.job, self.report
        if not (job.training and job.dtype == torch.float16
                and any(kp.name == "cast_to_half" for kp in self.kept)):
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


REPORT_PROFILE = ProfileSettings(wait=0, warmup=1, active=1)


# Sites of one signature are one region at one shape: a few of them (first, middle, last: the
# depths whose activations differ most) are verified against float64, not every layer, so
# verifying costs the same at any depth. The composed model is verified whole afterwards
# (rewriter.confirm), and a failure there rolls the rewrites back.
VERIFY_SAMPLE = 3


def _row_head(sig: str, members: list[tuple[GraphSlot, Region]], ran_in: Any) -> dict[str, Any]:
    """A signature's report row before it is decided; ``ran_in``: a dtype or its name."""
    first = members[0][1]
    return {"signature": sig, "sites": _calls(members), "example": first.label,
            "boundary": first.boundary, "kept": False,
            "ran_in": str(ran_in).replace("torch.", "")}


def _calls(members: list[tuple[GraphSlot, Region]]) -> int:
    """How often a signature's sites run in one call of the model: a site in a block's graph
    runs once per instance of the block."""
    return sum(slot.calls for slot, _ in members)


def _verify_sample(members: list) -> list:
    """The sites of one signature that are verified, in order: first (also the one measured),
    middle and last."""
    if len(members) <= VERIFY_SAMPLE:
        return members
    picks = sorted({round(i * (len(members) - 1) / (VERIFY_SAMPLE - 1)) for i in range(VERIFY_SAMPLE)})
    return [members[i] for i in picks]


def _saved(measurement: dict | None) -> float | None:
    if not measurement or measurement.get("baseline_ms") is None or measurement.get("candidate_ms") is None:
        return None
    return measurement["baseline_ms"] - measurement["candidate_ms"]


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
