"""The optimize run: capture ▶ sites ▶ record ▶ verify ▶ measure per signature ▶ keep|revert ▶
confirm once on the step ▶ plan and report. One object owns the job from start to end::

    outcome = Run(job, passes, settings).execute()

Each pass is tried against what was kept before it (greedy; the precision pass as an overlay on
every variant: :meth:`Run._decide`). A pass of scope "site" is decided per region signature: the
sites are cut out (rewriter.capture.region), fed values recorded in one run of the model
(rewriter.capture.record), verified and timed on their own (rewriter.decide.site_gate); identical
sites are measured once, or not at all when the knowledge base knows the signature. A pass of
scope "step" and the fused optimizer (on its own step) are measured on the whole step, with peak
memory once (rewriter.decide.memory; ``objective="memory"`` keeps what lowers it within
``memory_slowdown``). At the end the composed model is verified and timed once against the
original (rewriter.decide.confirm). All inside :func:`rewriter.decide.state.preserved_state`: the
user's model, optimizer and RNG come out as they went in, also when a pass raises or the user
interrupts.

The flow is :meth:`Run._execute`; the stages it calls live by idea in mixins of ``Run``:
capturing (rewriter.capture.choose), a pass decided per region signature (rewriter.decide.regions),
a pass decided on the whole step, and the memory objective (rewriter.decide.step), plans and
replay (rewriter.decide.replay); the step check and the compile decision (decided first where it
would supersede the passes: rewriter.decide.compile_first) are objects of their own
(rewriter.decide.confirm, rewriter.decide.compile_gate), which read the run through rewriter.decide.run_view.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from rewriter import plan as plans
from rewriter.capture.choose import CaptureStage
from rewriter.capture.front_ends import Capture, DynamoCapture, GraphSlot
from rewriter.capture.regional import RegionalCapture
from rewriter.decide import memory
from rewriter.decide.amortize import MIN_BUDGET, PRECISION_FIRST_STEPS, deciding_budget
from rewriter.decide.compile_first import compile_first
from rewriter.decide.compile_gate import CompileGate
from rewriter.decide.confirm import Confirmation, KeptUnit, fewest_pairs
from rewriter.decide.gate import Clock, GateSettings, Step, device_clock, figure, measure
from rewriter.decide.job import Job, switched
from rewriter.decide.kept import KeptPass, apply_kept, build, overlay_for
from rewriter.decide.knowledge import KnowledgeBase
from rewriter.decide.optimizer_gate import gate_optimizer
from rewriter.decide.optimizer_gate import step_saved_ms as optimizer_saved_ms
from rewriter.decide.reference import Reference
from rewriter.decide.hot_first import HotFirst
from rewriter.decide.regions import RegionDecisions
from rewriter.decide.replay import PlanReplay, replay_on_slot
from rewriter.decide.state import preserved_state
from rewriter.decide.step import StepDecisions
from rewriter.devices import amp, optimizers
from rewriter.devices.weight_casts import copies_held
from rewriter.errors import CaptureError
from rewriter.pass_api import Pass, PassContext
from rewriter.profiling import ProfileSettings, record_run
from rewriter.report import Decision, Report

log = logging.getLogger("rewriter.progress")
# The name the step of the unrewritten installed graphs carries (a controlled clock costs it)
INSTALLED = "(installed graphs)"

DEFAULT_TIME_BUDGET = 60.0


@dataclass
class Settings:
    """How optimize() measures and decides (the keyword options of optimize())."""

    min_speedup: float = 1.05  # the region margin (and the bar for whole-step decisions)
    front_end: str = "auto"
    gate: GateSettings = field(default_factory=GateSettings)
    clock: Clock | None = None
    profile: bool | str = True  # "auto": profile unless steps= makes the run too short for it
    plan: Any = None
    replace_optimizer: bool = True  # False when optimize() already handed the optimizer back
    cache_dir: str | None = None  # decision cache: plans by fingerprint
    strict_plan: bool = False  # a plan that does not fit is an error (other ranks follow rank 0)
    time_budget: float | None = DEFAULT_TIME_BUDGET  # seconds for deciding (profiling aside)
    knowledge_base: KnowledgeBase = field(default_factory=lambda: KnowledgeBase(None))
    # the graph compiler as a gated candidate (rewriter.decide.compile_gate): "auto", True, False,
    # an executor name or a torch.compile backend callable
    compile: Any = False
    steps: int | None = None  # the run's expected steps or calls (rewriter.decide.amortize)
    objective: str = "time"  # "memory": keep what lowers peak memory within memory_slowdown
    memory_slowdown: float = 0.03
    # regional rewriting (rewriter.capture.blocks): "auto", True or False; see rewriter.api.optimize
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

    @property
    def blocks_compiled(self) -> bool:
        """The compiled form runs through the capture (a Dynamo/regional capture's graphs or
        blocks compiled), also with nothing rewritten kept."""
        return bool(self.compiled and "dynamo" in self.compiled)

    def fall_back_to_original(self, reason: str) -> None:
        """From now on the original model runs (e.g. hooks changed after optimize())."""
        self.use_original = True
        self.report.notes.append(reason)


def run_pipeline(job: Job, passes: list[Pass], settings: Settings) -> Outcome:
    return Run(job, passes, settings).execute()


class Run(RegionDecisions, StepDecisions, HotFirst, CaptureStage, PlanReplay):
    """One optimize() job: owns the capture, the reference numerics, the state snapshot, the
    kept decisions and the report."""

    def __init__(self, job: Job, passes: list[Pass], settings: Settings) -> None:
        self.job, self.passes, self.settings = job, passes, settings
        self.report = Report(model=type(job.model).__name__, device=job.backend.name, mode=job.mode,
                             dtype=str(job.dtype).replace("torch.", "") if job.dtype else None,
                             objective=settings.objective)
        if job.generation is not None:
            self.report.workload = job.generation.describe()
        self.clock = settings.clock or device_clock(job.backend)
        self.ctx = PassContext(job.backend, job.training, job.dtype, objective=settings.objective)
        # peak bytes of one run of a step: a controlled clock injects them in tests
        self.peak_of = getattr(self.clock, "peak_bytes", None) or (
            lambda step: memory.peak_bytes(step.run, job.backend))
        # outputs a drops_outputs pass set to None are not compared (objective="memory" only)
        self.may_drop_outputs = settings.objective == "memory" and any(
            p.drops_outputs for p in passes)
        self.kept: list[KeptPass] = []
        self.dispatch_ms = 0.0  # what the installed blocks cost a step before any rewrite
        self.units: list[KeptUnit] = []  # each kept decision, for the confirmation's ablation
        self.fused_opt: optimizers.OptimizerCandidate | None = None
        self.cap: Capture | None = None
        self.started = time.perf_counter()
        self.deadline = (self.started + settings.time_budget) if settings.time_budget else None
        self.step_seconds = 0.0
        self.run_is_short = False  # steps= shortened the time budget
        self.compiled: dict | None = None  # set by CompileGate when the compiled form is kept
        self.compile_plan: dict | None = None
        self.compiled_first: Decision | None = None  # decided first, not kept: not compiled again
        # the pass scan's figures (rewriter.decide.hot_first): original regions' ms by scan key,
        # and its recording, (what the model ran as, values), while deciding
        self._scanned: dict[tuple, float] = {}
        self._scan_values: tuple | None = None

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
        on, when any captured graph runs rewritten (a block's, or one outside the blocks: the
        graphs outside were captured with the blocks installed, and taking them off makes
        Dynamo trace the forwards that call the blocks again, inline, at the user's first step:
        LLaMA, 4 layers, only fuse_cross_entropy kept, 2-core Xeon: a first step of 1.26 s
        against 0.16 s engaged); otherwise they are taken off again."""
        cap: RegionalCapture = outcome.capture  # type: ignore[assignment]
        rows = cap.block_rows()
        for row in rows:  # which kept passes rewrite this block's graphs
            slots = [s for s in cap.slots if s.block == row["class"]]
            row["passes"] = [kp.name for kp in outcome.kept if any(
                (s.overlay is not None) if kp.pass_.sets_precision else
                apply_kept(s.original, kp, self.ctx, s.name) is not None for s in slots)]
        self.report.blocks = rows
        if cap.lifted_for_good:
            pass  # the compiled original model runs, guarded against the class patches as they are
        elif outcome.use_original or not (any(s.rewritten for s in cap.slots) or outcome.blocks_compiled):
            cap.remove()
        else:
            cap.engage()

    def _warm_step_seconds(self) -> float:
        """One more eager step, timed: on a device the reference run (the first) loads every kernel
        it launches, so it overstated the step (an H200: 930 ms for 18 ms; SDPA's 0.9 ms rejected)."""
        t0 = time.perf_counter()
        self.job.numerics(self.job.model)
        self.job.backend.synchronize()
        seconds = time.perf_counter() - t0
        self.snapshot.restore()
        return seconds

    def _execute(self) -> Outcome:
        job = self.job
        use_original = False
        with preserved_state(job.model, job.optimizer, job.backend.rng_states()) as snapshot:
            self.snapshot = snapshot
            with self._phase("reference"):
                t0 = time.perf_counter()
                self.reference = Reference(job, snapshot)
                job.backend.synchronize()
                self.step_seconds = time.perf_counter() - t0
                if job.backend.cold_first_run:
                    self.step_seconds = min(self.step_seconds, self._warm_step_seconds())
            self._fit_budget_to_the_run()
            try:
                with self._phase("capture"):
                    self.cap = self._checked_capture()
            except CaptureError as e:
                return self._capture_failed(e)
            snapshot.restore()
            if job.generation is not None and isinstance(self.cap, RegionalCapture):
                self._measure_dispatch()
            if isinstance(self.cap, DynamoCapture):
                self.cap.on_new_graph = self._on_new_graph
            fingerprint = self._fingerprint()
            plan = self._plan_to_replay(fingerprint)
            first = False  # the compile decided before the passes, and kept
            if plan is not None:
                self._replay(plan)
            else:
                if self.job.optimizer is not None:  # first: it saves the most per second of deciding
                    self._decide_optimizer()
                first = compile_first(self, self.passes)
                if not first:
                    self._decide()
                    use_original = not self._confirm()
                snapshot.restore()
            if use_original:
                self._drop_all()
            # the graph compiler: one more candidate, on the whole step
            if plan is not None:
                CompileGate(self).replay(plan.get("compile"))
            elif not first:
                CompileGate(self).decide()
            self.settings.knowledge_base.save()
            if self._profiles():
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
        held = copies_held(self.cap.slots, self.job.dtype) if self.kept else None
        if held:
            self.report.notes.append(held)
        self.report.optimize_seconds = time.perf_counter() - self.started
        log.info("rewriter: done in %.1f s: %s", self.report.optimize_seconds,
                 self.report.final.get("reason", ""))
        outcome = Outcome(self.report, self.cap, list(self.kept), not self.kept, self.ctx, optimizer,
                          loss_scale, self.compiled)
        # the original blocks compiled (nothing rewritten) run through the capture too
        outcome.use_original = outcome.use_original and not outcome.blocks_compiled
        return outcome

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
            self.report.phases[name] = round(self.report.phases.get(name, 0.0) + time.perf_counter() - t0, 3)

    def _remaining(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def _confirm_reserve(self) -> float:
        """Time kept back for the confirmation: the composed check and the fewest pairs of two
        steps that can answer it (all pointing faster; the usual pairs where the budget has
        them: LLaMA 32k at steps=100 kept 5.3 s back, the check took 1.9-2.4 s, and the loss
        was cut short)."""
        return self.step_seconds * (1 + 2 * fewest_pairs(self.settings.gate)) * 1.25

    def _out_of_time(self) -> bool:
        return self._remaining() < self._confirm_reserve()

    @property
    def decide_by(self) -> float | None:
        """When a decision's measuring stops: the budget's end less the confirmation's reserve,
        so the whole-step check still fits in the budget (None: no budget)."""
        return None if self.deadline is None else self.deadline - self._confirm_reserve()

    # --- deciding ----------------------------------------------------------------------------
    def _decide(self) -> None:
        """Every pass in order; with ``dtype=``, in the precision it will run in.

        The precision pass (cast_to_half) changes what every other rewrite is measured in, and
        its worth depends on them (a half GEMM on a transposed operand can be far slower than the
        fused kernel replacing it): the others are decided with it on top, speculatively, then it
        on the whole step with them in; rejected, the others are decided again at full precision.
        Under a tight budget (``PRECISION_FIRST_STEPS``) it comes first: the largest saving (1.5-
        1.9x of a bf16 step), the dearest pairs; the others had spent the budget (LLaMA bf16
        steps=100, Xeon with AMX: not reached, 1.08x kept). The fused optimizer is decided before
        (``_execute``): on its own step, it saves the most per second of deciding (LLaMA 32k
        words: ~48 ms a step for 1.0 s); then, where it would supersede them, compile_first.
        """
        precision = [p for p in self.passes if p.sets_precision]
        others = [p for p in self.passes if not p.sets_precision]
        speculate = [p for p in precision if p.applies_to(self.ctx) is None][:1]
        if speculate and self._remaining() < PRECISION_FIRST_STEPS * self.step_seconds:
            self._decide_each(precision)  # kept, the regions run in it (_region_overlay)
            precision, speculate = [], []
        if speculate and not self._runs_in_precision(speculate[0]):
            speculate = []  # decided last, its row says why (the check's failure again)
        self._decide_each(others)
        if speculate:
            self._set_overlay([])
        self._decide_each(precision)
        if speculate and not any(kp.pass_.sets_precision for kp in self.kept) \
                and any(d.regions or d.kept or d.pass_name in self._set_aside_for_precision
                        for d in self.report.decisions if d.pass_name in {p.name for p in others}):
            log.info("rewriter: %s was not kept: deciding the other passes again at full precision",
                     speculate[0].name)
            redo = {p.name for p in others}
            self.report.decisions = [d for d in self.report.decisions if d.pass_name not in redo]
            self.units = [u for u in self.units if u.pass_name not in redo]
            self.rebuild([])
            self._decide_each(others)
            self.report.notes.append(f"{speculate[0].name} was not kept, so the other passes were "
                                     "decided again at full precision")
        # the report lists the optimizer after the passes, as a replayed plan does
        rows = self.report.decisions
        self.report.decisions = [d for d in rows if d.pass_name != "fuse_optimizer"] + \
            [d for d in rows if d.pass_name == "fuse_optimizer"]

    def _set_overlay(self, kept: list[KeptPass]) -> None:
        overlay = overlay_for(kept, self.ctx)
        self._speculative = bool(kept)
        for slot in self.cap.slots:
            slot.set_overlay(overlay)

    def _decide_each(self, passes: list[Pass]) -> None:
        """Passes without sites at once, the others hottest first (rewriter.decide.hot_first);
        the report lists them as registered."""
        at_once, hot = self._hot_first(passes)
        rows, number = {}, {id(p): i for i, p in enumerate(passes, 1)}
        for p in at_once + hot:
            try:
                d = self._try(p)  # finding sites is cheap; measuring them checks the budget
            except Exception as e:  # noqa: BLE001 (a pass that raises is not kept; the run goes on)
                d = self._raised(p, e)
            self.snapshot.restore()
            rows[id(p)] = d
            log.info("rewriter: [%d/%d] %s: %s: %s", number[id(p)], len(passes), p.name, d.status, d.reason)
        self.report.decisions += [rows[id(p)] for p in passes]
        self._scan_values = None  # the scan's recording: let go

    def _decide_optimizer(self) -> None:
        if self._out_of_time():
            d = Decision("fuse_optimizer", False, "not reached",
                         f"the time budget ({self.budget_seconds:g} s) ran out first", scope="step")
        else:
            with self._phase("measure"):
                d, self.fused_opt = gate_optimizer(
                    self.job, self.clock, self.settings.gate, self.settings.min_speedup,
                    self.settings.replace_optimizer, self.decide_by, self.settings.knowledge_base)
            self.snapshot.restore()
            if self.fused_opt is not None:
                self.units.append(KeptUnit("fuse_optimizer", None, d.speedup, d.noise,
                                           optimizer_saved_ms(d.measurement), 1))
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
        why_not = p.applies_to(self.ctx) or self._not_in_precision(p) or self._no_fresh_pages(p)
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
        return self._kept_step(self.cap if self.kept else self.job.model, names, "optimized", twin)

    def _kept_step(self, model: Any, names: tuple[str, ...], label: str, optimizer: Any = None) -> Step:
        """The user's step with ``model`` standing in for theirs, every graph running what it
        keeps (no candidate)."""
        inner = self.job.step(model, optimizer=optimizer)

        def run() -> None:
            with switched(self.cap.switch, use_candidate=False):
                inner()
        return Step(run, names, label)

    def original_step(self) -> Step:
        return Step(self.job.step(self.job.model), (), "original")

    def _measure_dispatch(self) -> None:
        """Generation through a regional capture: what the blocks cost run through their
        installed graphs before any rewrite, timed once against the original step. It is a cost
        per block call that no region measures (a one-token decode call is short), so the step
        check weighs the kept regions' saving net of it (rewriter.decide.confirm)."""
        with self._phase("measure"):
            m = measure(self.original_step(), self._kept_step(self.cap, (INSTALLED,), "captured"),
                        clock=self.clock, settings=self.settings.gate)
        self.snapshot.restore()
        if m.pairs and not m.busy and m.speedup + self.settings.gate.noise_widths * m.noise < 1.0:
            self.dispatch_ms = m.candidate_ms - m.baseline_ms
            self.report.notes.append(f"the blocks run through their installed graphs cost "
                                     f"{self.dispatch_ms:.2f} ms a step before any rewrite "
                                     f"({figure(m)}): the kept regions must save more")

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

    # --- after deciding ----------------------------------------------------------------------
    @property
    def budget_seconds(self) -> float | None:
        """The deciding time budget in force (time_budget, or less for a short run)."""
        return None if self.deadline is None else self.deadline - self.started

    def _fit_budget_to_the_run(self) -> None:
        """With ``steps`` known, deciding gets at most a tenth of the run (rewriter.decide.amortize)."""
        s = self.settings
        budget = deciding_budget(s.time_budget, s.steps, self.step_seconds)
        self.run_is_short = budget is not None and budget != s.time_budget
        if self.run_is_short:
            self.deadline = self.started + budget
            self.report.notes.append(
                f"time budget: {budget:.0f} s, a tenth of the run (steps={s.steps} of about "
                f"{1e3 * self.step_seconds:.0f} ms; at least {MIN_BUDGET:.0f} s)")

    def _profiles(self) -> bool:
        if self.settings.profile != "auto":
            return bool(self.settings.profile)
        if self.run_is_short:
            self.report.notes.append("profile: skipped, the run is short (steps=); profile=True "
                                     "profiles anyway")
            return False
        return True

    def _profile(self) -> None:
        """One warm-up and one active step each: the report's view, not a measurement. The
        tables are built when the report is first read (Report.profiles_later)."""
        job, report = self.job, self.report
        optimized = bool(self.kept) or self.fused_opt is not None or self.compiled is not None
        twin = self.fused_opt.twin(job.optimizer) if self.fused_opt is not None else None
        try:
            before = record_run(job.step(job.model), job.backend, settings=REPORT_PROFILE, label="original")
            after = None
            if optimized:
                run = self.cap if self.kept else job.model
                if self.compiled is not None:
                    run = self.compiled.get("dynamo") or self.compiled.get("original") or run
                after = record_run(job.step(run, optimizer=twin), job.backend,
                                   settings=REPORT_PROFILE, label="optimized")
            report.profiles_later(before, after)
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
