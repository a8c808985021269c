"""Deciding a pass on the whole step (passes without a local region: precision, layout), with
the peak-memory objective, and verifying a candidate against the original's numerics. A mixin
of :class:`rewriter.pipeline.Run`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from typing import Any

from rewriter import plan as plans
from rewriter.capture.ir import structure_signature
from rewriter.decide import memory
from rewriter.decide.confirm import KeptUnit
from rewriter.decide.gate import Step, clearly_one_way, decide, figure, known_verdict, measure, saved_ms
from rewriter.decide.job import switched
from rewriter.decide.kept import KeptPass, mode_of, overlay_for
from rewriter.decide.knowledge import entry_key
from rewriter.decide.verify import compare_runs, tolerance_for
from rewriter.pass_api import Pass
from rewriter.report import Decision

log = logging.getLogger("rewriter.progress")


class StepDecisions:
    """Run's methods that decide a step-scope pass on the whole training or inference step."""

    # --- a pass decided on the whole step ------------------------------------------------------
    def _try_on_step(self, p: Pass, descriptions: list[str], note: str = "") -> Decision:
        if self._out_of_time():
            self._reject_all()
            return Decision(p.name, False, "not reached", f"{len(descriptions)} site(s) found; the "
                            f"time budget ({self.budget_seconds:g} s) ran out before measuring",
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
            saved = saved_ms(known)
            peaks: tuple[int | None, int | None] = (None, None)
        else:
            with self._phase("measure"):
                m = measure(self._variant_step(False, base, "kept"),
                            self._variant_step(True, base + (p.name,), "candidate"),
                            clock=self.clock, settings=self.settings.gate,
                            min_speedup=self.settings.min_speedup, deadline=self.decide_by,
                            early=clearly_one_way(self.settings.min_speedup, self.settings.gate))
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
        text = json.dumps({
            **what, "device": job.backend.name, "mode": mode_of(self.ctx),
            "dtype": str(job.dtype) if job.dtype else None,
            "tensors": plans.tensor_hash(job.model),
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

    def _runs_in_precision(self, p: Pass) -> bool:
        """The precision pass ``p`` set on top of the model for the others to be decided in
        (Run._decide), if the model runs in it and agrees with the original; else left off (a
        graph captured in fp32 may hold what the half dtype cannot: DeBERTa-v2's fill of fp32's
        ``finfo.min`` raised in bf16 before cast_to_half saturated it)."""
        self._set_overlay([KeptPass(p)])
        with self._phase("verify"):
            ok, detail, _ = self._verify_candidate(composed=True)
        if not ok:
            self._set_overlay([])
            log.info("rewriter: %s: the other passes decided without it: %s", p.name, detail)
        return ok

    def _raised(self, p: Pass, e: Exception) -> Decision:
        """``p``'s decision raised: rolled back (its candidate graphs, anything of it kept), not kept;
        the caller (Run._decide_each) restores the snapshot, as after every decision."""
        self._reject_all()
        if any(kp.pass_ is p for kp in self.kept):
            self.units = [u for u in self.units if u.pass_name != p.name]
            self.rebuild([kp for kp in self.kept if kp.pass_ is not p])
        return Decision(p.name, False, "raised", f"raised while decided: {type(e).__name__}: {e}", scope=p.scope)

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



