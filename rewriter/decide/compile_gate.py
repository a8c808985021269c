"""The graph compiler as one more gated candidate, decided on the whole step.

After the rewrites are decided and confirmed, each executor the device has
(rewriter.devices.executors) compiles the model as it now runs; with graph rewrites kept, also
the original model compiled whole (``CompiledOriginal``), so the compiler is never handed only a
worse input than the model's own code. Under a regional capture one compile is paid: in fp32
the regional compile (every graph once, built without the kept rewrites the compiler makes
itself, :data:`COMPILER_DOES_ITSELF`; where a loss graph left eager reads logits with arithmetic
of its own, a second form compiles it too, paying for that graph only: :meth:`_heads_offered`);
beside a kept bf16 precision in training, the original
model under autocast compiled whole, its repeated blocks nested compile regions (Inductor; one
that raises or fails verification is compiled again without them; CPU: its losses in compiler
forms, CompiledOriginal's ``loss_forms``; decided first where it would supersede every rewrite:
rewriter.decide.compile_first). Which forms, and why: :meth:`_forms`, the README. Verified like
any rewrite (dropout: same_masks.py), timed against the rewritten eager step by the step-scope
rules (gate.decide) at half the region margin (:func:`compile_margin`), its pairs going on while
inconclusive for up to half its compile's seconds (amortize.measuring_paid)::

    CompileGate(run).decide()          # optimize(compile=True)
    CompileGate(run).replay(entry)     # a plan's {"executor": ..., "kept": True}: no measuring

A compile is a one-time cost (rewriter.decide.amortize): with ``compile="auto"`` or ``steps`` it
is first predicted and not paid when even saving half of every step would not repay it within
the first tenth of the run; a faster compiled form is kept only when its measured saving repays
its measured seconds within the run. Inductor's caches live beside the knowledge base
(rewriter.devices.compile_cache); the decision goes into it and the plan.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from rewriter import plan as plans
from rewriter.capture.front_ends import DynamoCapture, FxCapture
from rewriter.capture.ir import structure_signature
from rewriter.capture.regional import RegionalCapture
from rewriter.decide.amortize import (DEFAULT_STEPS, Payback, compile_time_limit, measuring_paid,
                                      predict_compile_seconds)
from rewriter.decide.compile_offers import (NAME, abandoned, abandoned_before, not_worth_compiling,
                                            regional_not_offered, whole_not_offered)
from rewriter.decide.compile_size import compile_nodes, repeated_nodes
from rewriter.decide.gate import Step, clearly_one_way, decide, known_verdict, measure, ran_warm, saved_ms
from rewriter.decide.job import switched
from rewriter.decide.knowledge import entry_key
from rewriter.decide.run_view import RunView
from rewriter.decide.same_masks import verify_compiled
from rewriter.decide.set_aside import compile_sources, compiled_heads
from rewriter.devices.compile_cache import cache_folder, is_warm, use_persistent_cache
from rewriter.devices.compile_limit import CompileLimit
from rewriter.devices.isa_probes import start_vec_isa_probes, wait as wait_for_isa_probes
from rewriter.devices.executors import (
    CompiledOriginal,
    Executor,
    RegionalCompiled,
    compiled_runner,
    executors_for,
    has_dropout,
)
from rewriter.report import Decision

log = logging.getLogger("rewriter.progress")

# Graph rewrites Inductor makes itself on CPU and CUDA, and how: a regional capture's compile is
# handed graphs built without these (with only the kept rewrites the compiler cannot make), so
# the compiler is never given a worse input than the model's own code and one compile is paid,
# not two. NPU: torch_npu's fused operators, which no compiler there makes itself. Not
# fuse_attention: Inductor's SDPA patterns match some written-out forms only, and BERT's eager
# attention compiled lost to SDPA compiled (fresh processes beside SDPA + fused AdamW, eager,
# training, 2-core Xeon without AMX: each layer 0.97x against 1.00x, whole 1.03x vs 1.06x).
COMPILER_DOES_ITSELF: dict[str, str] = {
    "fuse_gelu": "pointwise fusion of the written-out tanh GELU",
    "fuse_layer_norm": "fusion of the mean/variance reductions and their pointwise ops",
    "fuse_rms_norm": "fusion of the mean-square reduction and its pointwise ops",
    "make_contiguous": "its own layout and copy decisions",
    "fuse_cross_entropy": "fusion of the loss's log-softmax, its backward and their reductions",
}
FUSING_EXECUTORS = ("inductor",)  # the executors the table speaks for


def compile_margin(min_speedup: float) -> float:
    """The speedup a compiled form must show over the eager step: half the region margin's
    (1.025 for the default 1.05). The region margin covers what a region's figure may not carry
    over to the step; a compile is measured as the step itself, and its one-time cost is weighed
    on its own (rewriter.decide.amortize); half of it stays against what a step's timing does not
    show (a recompile for a new shape). GPT-NeoX, fp32, the Xeon with AMX: its regional compile
    read 1.045x ±0.001 over the eager step (~8 ms a step, its 6.8 s repaid within ~900 steps)
    and was rejected under 1.05."""
    return 1.0 + (min_speedup - 1.0) / 2
INDUCTOR_DEVICES = ("cpu", "cuda")


class CompileGate:
    """The compile decision of one Run. Sets ``run.compiled`` (how the wrapper runs the
    compiled form, or None) and ``run.compile_plan`` (the plan's record of the decision)."""

    def __init__(self, run: RunView) -> None:
        self.run = run
        self._replaying = False  # a plan's compile: what the plan keeps, nothing set aside
        self._unnested = False  # the blocks nested raised or failed verification: not again
        self._masks = False  # the form built last draws eager's dropout masks (same_masks.py)
        self._heads = False  # the form offered now compiles the loss graphs too (:meth:`_heads_offered`)
        self._limit = CompileLimit(None)  # the compile being tried: its time limit (attempt)
        # autocast, no precision pass kept (compile_first, a plan's); the eager step timed against
        self.under_autocast, self.baseline = False, None

    # --- deciding ------------------------------------------------------------------------------
    def decide(self) -> None:
        r = self.run
        choice = r.settings.compile
        if choice is False:
            return
        found, declined = executors_for(r.job.backend, True if choice == "auto" else choice,
                                        r.job.training)
        if not found:
            r.report.decisions.append(Decision(NAME, False, "not available",
                                               "; ".join(declined) or "no executor", scope="step"))
            return
        if declined:
            r.report.notes.append("compile: not tried: " + "; ".join(declined))
        steps = self.steps()
        tried, not_offered = [], []
        if r.compiled_first is not None:  # decided first and not kept: its row, not again
            r.report.decisions.append(r.compiled_first)
        for ex in found:
            # the candidates (:meth:`_forms`): the compiler is never handed a worse input than
            # the model's own code, and the fastest one verified runs
            for original in self._forms(ex):
                if not (original and r.compiled_first is not None):
                    self._offer(ex, original, choice, steps, tried)
            mine = [t for t in tried if t[2] is ex]  # a second form only where the first ran
            if mine and mine[-1][0].status in ("kept", "rejected") and self._heads_offered(ex):
                self._heads = True  # one more: the loss graphs with arithmetic compiled too
                try:
                    self._offer(ex, False, choice, steps, tried)
                finally:
                    self._heads = False
            row = whole_not_offered(self, ex) or regional_not_offered(self, ex)
            if row is not None:
                not_offered.append(row)
        kept = [t for t in tried if t[0].kept]
        best = max(kept, key=lambda t: t[0].speedup or 0.0) if kept else None
        for d, _, ex, original in tried:
            if best is not None and d.kept and d is not best[0]:
                d.kept, d.status = False, "rejected"
                d.reason = f"{best[0].sites[0]} is faster still; {d.reason}"
            r.report.decisions.append(d)
            log.info("rewriter: compile (%s): %s: %s", d.sites[0], d.status, d.reason)
        r.report.decisions += not_offered  # after the rows of what was tried
        if best is not None:
            if best[3]:
                self._prefer_original(best[0], best[1])
            elif getattr(best[1], "set_aside", ()):  # graphs without those rewrites, regionally
                self._supersede(best[0], f"the graphs compiled without them ({best[0].sites[0]}) run",
                                keep=[kp for kp in r.kept if kp.name not in best[1].set_aside])
            self._install(best[1], best[2])
        else:
            r.compile_plan = {"executor": found[0].name, "kept": False}

    def _offer(self, ex: Executor, original: bool, choice: Any, steps: int | None, tried: list) -> None:
        """One candidate: weighed against the run, then tried (``tried``) or said not tried."""
        key, known, skip, predicted = self.weighed(ex, original, choice, steps)
        if skip is not None:
            self.run.report.decisions.append(skip)
            log.info("rewriter: compile (%s): not tried: %s", self._label(ex, original), skip.reason)
        else:
            tried.append(self.attempt(ex, steps, key, known, original, predicted))

    def _heads_offered(self, ex: Executor) -> bool:
        """Whether the regional compile has a second form: a graph outside the blocks that runs a
        set-aside rewrite, its loss reading logits with arithmetic of its own, compiled too
        (rewriter.decide.set_aside)."""
        aside = self._set_aside(ex)
        return bool(aside) and bool(compiled_heads(self.run, aside))

    def weighed(self, ex: Executor, original: bool, choice: Any, steps: int | None
                ) -> tuple[str, dict | None, Decision | None, tuple[float, str, int]]:
        """(knowledge-base key, its entry, a "not tried" row if the predicted compile would not repay
        within the run, the prediction); the whole model's, when the run's length is known."""
        r = self.run
        key = self._key(ex, original)
        known = r.settings.knowledge_base.get(key)
        if original and known and "nesting_failed" in known:  # an earlier run's fallback
            self._unnested = True
            key = self._key(ex, original)
            known = r.settings.knowledge_base.get(key)
        weigh = choice == "auto" or (original and r.settings.steps is not None)
        predicted = self._predicted(ex, known, original)
        skip = abandoned_before(self, ex, original, self._time_limit(steps, predicted))
        if skip is None and weigh:
            skip = not_worth_compiling(self, ex, steps, known, predicted, original)
        return key, known, skip, predicted

    def attempt(self, ex: Executor, steps: int | None, key: str, known: dict | None, original: bool,
                predicted: tuple[float, str, int]) -> tuple[Decision, Callable[..., Any] | None, Executor, bool]:
        """:meth:`_try`, said first: the longest silence of a run."""
        log.info("rewriter: compile (%s): compiling, about %.0f s (%s), then verifying and measuring",
                 self._label(ex, original), *predicted[:2])
        self._limit = CompileLimit(self._time_limit(steps, predicted))
        try:
            return self._try(ex, steps, key, known, original)
        finally:
            self._limit = CompileLimit(None)

    def _time_limit(self, steps: int | None, predicted: tuple[float, str, int]) -> float | None:
        """The seconds the compile may run (rewriter.decide.amortize.compile_time_limit)."""
        return compile_time_limit(steps, self.run.step_seconds, predicted[0])

    def _set_aside(self, ex: Executor) -> list[str]:
        """Under a regional capture (no kept bf16 precision to run as autocast), the kept graph
        rewrites ``ex`` makes itself (:data:`COMPILER_DOES_ITSELF`): the regional compile, the one
        candidate, is handed graphs built without them (a graph outside the blocks that runs one
        stays eager with it, rewriter.decide.set_aside); kept, they are superseded. Training,
        beside SDPA + fused AdamW (2-core Xeon without AMX): GPT-2 each layer compiled 1.09x
        with its eager attention and GELU, 1.07x with SDPA; LLaMA 1.09x / 1.05x."""
        r = self.run
        if self._replaying or not (self._regional_one_candidate() and ex.name in FUSING_EXECUTORS
                and r.job.backend.name in INDUCTOR_DEVICES):
            return []
        return [kp.name for kp in r.kept if kp.name in COMPILER_DOES_ITSELF]

    def _sources(self, ex: Executor) -> tuple[Callable[[Any], Any] | None, list[str]]:
        """(what each graph's compile gets, None: what it keeps; the set-aside rewrites that then
        run nowhere): rewriter.decide.set_aside."""
        aside = self._set_aside(ex)
        return compile_sources(self.run, aside, heads=self._heads) if aside else (None, [])

    def _regional_one_candidate(self) -> bool:
        """A regional capture, not a generation, no kept precision to run as autocast: the
        regional compile (every graph once) is the one candidate, the whole model's compile not
        offered beside it (with a kept bf16 precision, see :meth:`_forms`)."""
        r = self.run
        return isinstance(r.cap, RegionalCapture) and r.job.generation is None and self._autocast() is None

    def _weighed(self) -> bool:
        """Whether a compile's cost can be weighed against the run: ``compile="auto"`` or
        ``steps`` given."""
        r = self.run
        return r.settings.compile == "auto" or r.settings.steps is not None

    def _forms(self, ex: Executor) -> tuple[bool, ...]:
        """The candidates, each ``original`` or not (the model as it now runs, compiled): under
        a regional capture one (:meth:`_regional_one_candidate`; beside a kept bf16 precision,
        in training, the original model under autocast, rewriter.decide.compile_offers, in
        inference both); otherwise the rewritten model, and the original one beside it when
        rewrites are kept (else the original is what is compiled anyway), a kept precision can
        run as autocast (bf16: a precision pass is a rewrite the compiler cannot make; fp16's
        loss scaling lives in the rewritten model only) and the model is called once a step (a
        generation's decode calls compile through CompiledForward)."""
        r = self.run
        if self._regional_one_candidate():
            return (False,)
        if isinstance(r.cap, RegionalCapture) and r.job.generation is None:  # a kept bf16 precision
            if r.job.training:
                return (True,)  # the original model under autocast
            # inference: the bf16 graphs hold their weights cast once (weight_casts), which the
            # original under autocast casts at every call; unmeasured against each other, both
            # stay, the whole model's compile (a second one) only when weighed
            return (False, True) if self._weighed() else (False,)
        beside = bool(r.kept) and r.job.generation is None and \
            (self._autocast() is not None or not any(kp.pass_.sets_precision for kp in r.kept))
        return (False, True) if beside else (False,)

    def _label(self, ex: Executor, original: bool) -> str:
        """A compile candidate's name in the report: the executor, and which model it compiles."""
        if not original:
            aside = self._sources(ex)[1]  # the set-aside rewrites that then run nowhere
            if not aside:
                return ex.name
            every = len(aside) == len(self.run.kept)  # nothing rewritten left: the original graphs
            heads = "; the loss graph compiled" if self._heads else ""
            return f"{ex.name} (original graphs{heads})" if every else f"{ex.name} (without {', '.join(aside)}{heads})"
        autocast = self._autocast()
        return f"{ex.name} (original model" + (", blocks nested" if self._nests(ex) else "") + \
            (f", autocast {str(autocast[1]).split('.')[-1]})" if autocast else ")")

    def _nests(self, ex: Executor) -> bool:
        """The original model compiled whole nests its repeated blocks (Inductor: CompiledOriginal);
        not where a training step's dropout is verified off: a reused region kept it in that
        compile (OPT, torch 2.13, aot_eager too). Verified with the same masks, it nests."""
        r = self.run
        return ex.name == "inductor" and r.cap.nests and not self._unnested and not (
            r.job.training and has_dropout(r.cap, r.job.model) and not self._same_masks(ex))

    def _same_masks(self, ex: Executor, original: bool = True) -> bool:
        r = self.run  # the model's own code compiled draws eager's dropout masks (same_masks.py)
        return self._cpu_training(ex) and has_dropout(r.cap, r.job.model) and (original or not (r.kept or self._blocks_form()))

    def _cpu_training(self, ex: Executor) -> bool:  # where same masks and loss forms were measured
        return ex.name == "inductor" and self.run.job.backend.name == "cpu" and self.run.job.training

    def _blocks_form(self) -> bool:
        """Nothing rewritten kept under a regional capture (training, or one call a step): the
        compiled form is still regional, each block's own graph compiled once for all its
        instances and each graph around them once, so the compile does not grow with depth."""
        r = self.run
        return not r.kept and isinstance(r.cap, RegionalCapture) and r.job.generation is None

    def _autocast(self) -> tuple[str, Any] | None:
        """The precision the kept rewrites set, for the original model compiled: (device type,
        bf16) under a kept precision pass with ``dtype=torch.bfloat16``, else None."""
        r = self.run
        if r.job.dtype is torch.bfloat16 and (self.under_autocast or any(kp.pass_.sets_precision for kp in r.kept)):
            return r.job.backend.name, torch.bfloat16  # "cpu", "cuda", "npu": autocast's device types
        return None

    def _prefer_original(self, decision: Decision, runner: CompiledOriginal) -> None:
        """The original model compiled beat the rewritten one: it runs (with the fused
        optimizer, if kept); the graph rewrites are superseded, the slots back to the original
        graphs, and a regional capture's installations lifted for good."""
        self._supersede(decision, f"the original model compiled ({decision.sites[0]}) runs")
        if isinstance(self.run.cap, RegionalCapture):
            self.run.cap.lift_for_good(nest=runner.nest)

    def _supersede(self, decision: Decision, what: str, keep: list | None = None) -> None:
        """A compile without the kept graph rewrites (``what``; but those in ``keep``) is kept:
        the others' rows say they are superseded, and every slot is rebuilt with ``keep`` only
        (the plan keeps those)."""
        r = self.run
        keep = keep or []
        names = {kp.name for kp in r.kept} - {kp.name for kp in keep}
        for d in r.report.decisions:
            if d.pass_name in names and d.kept:
                d.kept, d.status = False, "superseded"
                d.reason = f"superseded: {what}, {_figure_of(decision)}; {d.reason}"
        r.units = [u for u in r.units if u.pass_name not in names]
        r.report.final["reason"] = (f"{r.report.final.get('reason', '')}; then superseded: {what}, "
                                    f"{_figure_of(decision)}").lstrip("; ")
        r.rebuild(keep)  # every slot from its original graph, with ``keep`` only

    def steps(self) -> int | None:
        """The run's length the one-time cost is weighed against (None: not weighed)."""
        s = self.run.settings
        return s.steps if s.steps is not None else (DEFAULT_STEPS if s.compile == "auto" else None)

    def _predicted(self, ex: Executor, known: dict | None, original: bool) -> tuple[float, str, int]:
        """Seconds the compile is expected to take, where that figure comes from, and the graph
        calls it is handed."""
        r = self.run
        cache = cache_folder(r.settings.knowledge_base.path) if ex.backend == "inductor" else None
        known_s = known.get("compile_seconds") if known else None
        # a cold figure, and the cache it was compiled into still holds it: the next is warm
        warm = known_s is not None and not known.get("compile_warm") and _cached(known, cache)
        nodes = compile_nodes(r, original, set_aside=bool(self._set_aside(ex)))
        again = repeated_nodes(r, original)
        source = ("the knowledge base's figure" + (", warm cache" if warm else "")) if known_s is not None \
            else f"predicted from {nodes} graph nodes" + (f", {again} of them repeated blocks" if again else "")
        return predict_compile_seconds(nodes, r.job.training, known_s, warm, again,
                                       nested=original and self._nests(ex)), source, nodes

    def _cache(self, ex: Executor) -> str | None:
        """Inductor's persistent cache folder, set beside the knowledge base unless set."""
        if ex.backend != "inductor":
            return None
        return use_persistent_cache(self.run.settings.knowledge_base.path)

    def _try(self, ex: Executor, steps: int | None, key: str, known: dict | None,
             original: bool = False) -> tuple[Decision, Callable[..., Any] | None, Executor, bool]:
        r = self.run
        cache = self._cache(ex)
        warm = _cached(known, cache)  # this compile loads what an earlier one stored
        runner, compile_s, failed, detail, err = self._verified_build(ex, original)
        if self._limit.overran:  # stopped: remembered, so the next run does not pay it again
            return abandoned(self, ex, original, compile_s, detail), None, ex, original
        nesting = ""
        if failed and original and self._nests(ex):
            # torch 2.13: a region with a side effect (Mistral's output recording) raises
            nesting = f"; with its blocks nested it {failed} ({detail[:200]}), compiled again without them"
            log.warning("rewriter: compile (%s): %s", self._label(ex, original), nesting[2:])
            r.settings.knowledge_base.put(key, {"pass": NAME, "nesting_failed": detail[:500]})
            self._unnested = True
            key = self._key(ex, original)  # the form compiled next
            runner, again_s, failed, detail, err = self._verified_build(ex, original)
            compile_s += again_s  # both compiles are paid
        if failed:
            return self._failed(ex, failed, detail + nesting, err, original), None, ex, original
        g, margin = r.settings.gate, compile_margin(r.settings.min_speedup)
        if known is not None:
            keep, reason = known_verdict(known, margin, g.noise_widths)
            m_dict = dict(known)
        else:
            # Compiling was asked for: past the budget, still time for the fewest pairs of the
            # two steps (twice the step check's reserve: warm-up included); never kept unmeasured.
            deadline = None if r.deadline is None else max(
                r.deadline, time.perf_counter() + 2 * r._confirm_reserve())
            with r._phase("measure"):  # both steps have run warm: the compiled one compiling
                m = measure(self.baseline or r.composed_step(), self._step(runner), clock=r.clock,
                            settings=measuring_paid(ran_warm(g), compile_s), min_speedup=margin,
                            deadline=deadline, early=clearly_one_way(margin, g))
            r.snapshot.restore()
            keep, reason = decide(m, margin, g.noise_widths)
            m_dict = m.to_dict()
            if m.storable(g.min_pairs):
                r.settings.knowledge_base.put(key, {**m_dict, "pass": NAME, "executor": ex.name,
                                                    "compile_seconds": round(compile_s, 3),
                                                    "compile_cache": cache, "compile_warm": warm})
        m_dict["compile_seconds"] = round(compile_s, 3)
        step_saving_ms = saved_ms(m_dict)
        if steps is not None and step_saving_ms is not None:
            p = Payback(compile_s, step_saving_ms / 1e3, steps)
            m_dict.update(p.to_dict())
            if keep and not p.repays_in_run:  # paid already: kept while it repays in the run
                keep, reason = False, f"does not repay within the run: {p.describe(paid=True)}; {reason}"
            elif keep:
                reason = f"{reason}; {p.describe(paid=True)}"
        d = Decision(NAME, keep, "kept" if keep else "rejected",
                     f"{self._label(ex, original)}, whole step: {reason}; first compiled step {compile_s:.1f} s"
                     + nesting,
                     speedup=m_dict.get("speedup"), noise=m_dict.get("noise"), max_abs_error=err,
                     sites=[self._label(ex, original)], measurement=m_dict, verification=detail, scope="step")
        return d, runner, ex, original

    # --- replaying a plan ----------------------------------------------------------------------
    def replay(self, entry: dict | None) -> None:
        """Compile as the plan says, verify, keep without measuring."""
        r = self.run
        if not entry or not entry.get("kept") or r.settings.compile is False:
            return
        choice = r.settings.compile if callable(r.settings.compile) else entry["executor"]
        try:
            found, declined = executors_for(r.job.backend, choice, r.job.training)
        except ValueError as e:
            found, declined = [], [str(e)]
        if not found:
            r.report.decisions.append(Decision(NAME, False, "not available",
                                               "; ".join(declined), scope="step"))
            return
        ex = found[0]
        # the form the plan kept (what was measured), whatever would be offered afresh: a
        # compile with rewrites set aside left them out of the plan's kept passes
        original = entry.get("form") == "original" and r.job.generation is None
        self._replaying, self._unnested = True, not entry.get("nested")  # as it was measured
        self.under_autocast = entry.get("autocast") == "bfloat16"  # no precision pass in the plan
        runner, compile_s, failed, detail, err = self._verified_build(ex, original)
        if failed:
            r.report.decisions.append(self._failed(ex, failed, detail, err))
            return
        r.report.decisions.append(Decision(
            NAME, True, "replayed", f"{ex.name}: from plan, not measured; first compiled step "
            f"{compile_s:.1f} s", max_abs_error=err, sites=[ex.name],
            measurement={"compile_seconds": round(compile_s, 3)}, verification=detail, scope="step"))
        if original and isinstance(r.cap, RegionalCapture):
            r.cap.lift_for_good(nest=runner.nest)
        self._install(runner, ex)

    # --- parts ---------------------------------------------------------------------------------
    def _build(self, ex: Executor, original: bool = False) -> tuple[Callable[..., Any] | None, float, str | None]:
        """The compiled runner, compiled by one step run through it (the user's first step's
        time); ``original``: the original model compiled whole (:class:`CompiledOriginal`)."""
        t0 = time.perf_counter()
        # a cold Inductor builds a test program per ISA, one after another: side by side here,
        # ended before the compiled step is timed
        builds = start_vec_isa_probes() if ex.backend == "inductor" and self.run.job.backend.name == "cpu" else []
        try:
            runner, problem = self._compiled(ex, original)
        finally:
            wait_for_isa_probes(builds)
        return runner, time.perf_counter() - t0, problem

    def _compiled(self, ex: Executor, original: bool) -> tuple[Callable[..., Any] | None, str | None]:
        r = self.run
        self._masks = self._same_masks(ex, original)
        if original:
            try:
                with r._phase("compile"), self._limit:
                    runner = CompiledOriginal(r.job.model, r.cap, ex.resolve(), self._autocast(),
                                              nest=self._nests(ex), same_masks=self._masks,
                                              loss_forms=self._cpu_training(ex))
                    self._step(runner).run()
            except Exception as e:
                return None, \
                    f"{ex.name} raised while compiling the original model: {type(e).__name__}: {e}"
            finally:
                r.snapshot.restore()
            return runner, None
        blocks = self._blocks_form()
        if not r.kept and not blocks and isinstance(r.cap, RegionalCapture):
            # nothing kept, a generation: the original model's forward is compiled, whole; the
            # installed blocks (opaque to a trace) and the untraced forwards are lifted first
            r.cap.remove()
        try:
            with r._phase("compile"), self._limit:
                source, superseded = self._sources(ex)
                runner = compiled_runner(r.job.model, r.cap if r.kept or blocks else None,
                                         ex.resolve(), r._on_new_graph,
                                         generation=r.job.generation is not None,
                                         source=source, set_aside=superseded, same_masks=self._masks)
                self._step(runner).run()
        except Exception as e:  # the backend raised: the eager graphs run
            return None, f"{ex.name} raised while compiling: {type(e).__name__}: {e}"
        finally:
            r.snapshot.restore()
        return runner, None

    def _verified_build(self, ex: Executor, original: bool) -> tuple[Any, float, str | None, str, float | None]:
        """(runner, its compile seconds, None or how it failed: "raised" or "failed
        verification", the verification's words or why, max error)."""
        runner, compile_s, problem = self._build(ex, original)
        if problem is not None:
            return None, compile_s, "raised", problem, None
        ok, detail, err = self._verify(runner)
        return runner, compile_s, None if ok else "failed verification", detail, err

    def _step(self, runner: Callable[..., Any]) -> Step:
        """The composed step with the compiled runner (the original model's: the fused optimizer's)."""
        r = self.run
        base = r.composed_step()
        twin = r.fused_opt.twin(r.job.optimizer) if r.fused_opt is not None else None
        inner = r.job.step(runner, optimizer=twin)
        if isinstance(runner, CompiledOriginal):
            passes = (("fuse_optimizer",) if r.fused_opt else ()) + (NAME, "original")
        elif getattr(runner, "set_aside", ()):  # "original": the test clocks' name for set aside
            passes = tuple(p for p in base.passes if p not in runner.set_aside) + (NAME, "original")
        else:
            passes = base.passes + (NAME,)

        def run() -> None:
            with switched(r.cap.switch, use_candidate=False):
                inner()
        return Step(run, passes, "compiled")

    def _verify(self, runner: Callable[..., Any]) -> tuple[bool, str, float | None]:
        autocast = getattr(runner, "autocast", None) if isinstance(runner, CompiledOriginal) else None
        return verify_compiled(self.run, runner, self._masks, autocast)

    def _failed(self, ex: Executor, status: str, reason: str, err: float | None = None,
                original: bool = False) -> Decision:
        log.warning("rewriter: compile (%s): %s; the eager graphs run", self._label(ex, original), reason)
        return Decision(NAME, False, status, f"{reason}; the eager graphs run", max_abs_error=err,
                        sites=[self._label(ex, original)], scope="step")

    def _key(self, ex: Executor, original: bool = False) -> str:
        r = self.run
        aside, masks = ([] if original else self._set_aside(ex)), self._same_masks(ex, original)
        rewritten = r.kept and not original
        graphs = [structure_signature(s.kept_run) for s in r.cap.slots] if rewritten \
            else [structure_signature(s.original) for s in r.cap.slots]
        # a regional compile compiles every graph (before this form name, the blocks only)
        regional = isinstance(r.cap, RegionalCapture) and r.job.generation is None
        form = (" (original, blocks nested" if self._nests(ex) else " (original") + \
            (", same masks)" if masks else ")") if original else \
            (" (regional" + (f", without {','.join(aside)}, " + ("loss graph compiled" if self._heads else
                                                              "eager outside") if aside else "") + ")"
             if regional else "") + (" (same masks)" if masks else "")
        form += " (against the eager step under autocast)" if self.baseline is not None else ""
        text = "|".join([NAME, ex.name + form, r.job.backend.name,
                         r.job.mode, str(r.job.dtype), plans.graph_hash(graphs),
                         plans.tensor_hash(r.job.model),  # op names alone: LLaMA's and Qwen2's
                         ",".join(plans.input_signature(r.job.args, r.job.kwargs)),
                         ",".join(kp.name for kp in r.kept) if rewritten else "",
                         r.fused_opt.description if r.fused_opt else "-"])
        return entry_key(text, r.job.step_knowledge_key())

    def _install(self, runner: Callable[..., Any], ex: Executor) -> None:
        """What the wrapper runs from now on (OptimizedModel's ``_compiled`` layout)."""
        r = self.run
        if not r.kept and not isinstance(runner, RegionalCompiled):
            r.compiled = {"original": runner}
        elif isinstance(r.cap, DynamoCapture):
            r.compiled = {"dynamo": runner}
            if hasattr(runner, "keep"):  # regional: the installed blocks run compiled too
                runner.keep()
        elif isinstance(r.cap, FxCapture):
            r.cap.slots[0].compiled = runner.fn  # the capture now runs the compiled graph
            r.compiled = {"fx": ex.resolve()}
        r.compile_plan = {"executor": ex.name, "kept": True}
        if isinstance(runner, CompiledOriginal):
            r.compile_plan.update(form="original", nested=runner.nest)
            if runner.autocast is not None:  # the precision pass is superseded: out of the plan
                r.compile_plan["autocast"] = str(runner.autocast[1]).split(".")[-1]
        elif getattr(runner, "set_aside", ()):  # superseded, out of the plan's kept passes
            r.compile_plan["set_aside"] = list(runner.set_aside)
        if not r.report.final.get("kept"):  # no rewrite kept: the original model, compiled, runs
            r.report.final.update(kept=True, reason=f"{r.report.final.get('reason', 'no rewrite was kept')}; "
                                  f"the model compiled with {ex.name} runs")
        r.report.final["compiled"] = ex.name
        r.report.notes.append(f"compiled with {ex.name} (gated on the whole step)")


def _figure_of(d: Decision) -> str:
    """A kept compile row's speedup, in words."""
    return f"{d.speedup:.3f}x over the rewritten eager step" if d.speedup else "measured faster"


def _cached(known: dict | None, cache: str | None) -> bool:
    """Whether the compile ``known`` records went into ``cache``, and it still holds artefacts."""
    return known is not None and known.get("compile_cache") == cache and is_warm(cache)
