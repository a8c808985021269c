"""Deciding a pass per region signature: the sites cut out as regions, recorded, verified on a
sample and timed once per signature (or known from the knowledge base), weighted by how often
each runs in a step. A mixin of :class:`rewriter.pipeline.Run`, which owns the state it reads.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import defaultdict
from typing import Any

import torch

from rewriter.capture.front_ends import GraphSlot
from rewriter.capture.record import Recorded, Recorder, RecordingDone
from rewriter.capture.region import Region, captured_dtype, dtype_of_region, find_regions
from rewriter.decide import memory
from rewriter.decide.confirm import KeptUnit
from rewriter.decide.fresh_heap import FRESH_PAGES, STEP_TRIES, step_maps_fresh_pages
from rewriter.decide.gate import decide, host_page_faults, known_verdict, saved_ms
from rewriter.decide.job import VERIFY_SEED, switched
from rewriter.decide.kept import KeptPass, apply_sites, mode_of, overlay_for
from rewriter.decide.knowledge import entry_key
from rewriter.decide.site_gate import (
    REGION_TIMING,
    held_for_backward,
    least_measuring_seconds,
    measure_region,
    original_ms,
    verify_region,
)
from rewriter.decide.verify import Comparison
from rewriter.devices.gathered import fsdp2_modules
from rewriter.pass_api import Pass
from rewriter.report import Decision

log = logging.getLogger("rewriter.progress")


class RegionDecisions:
    """Run's methods that decide a site-scope pass region signature by region signature."""

    _set_aside_for_precision: frozenset[str] = frozenset()  # see _not_in_precision
    _fresh_heap_answer: bool | None = None  # see _fresh_heap: counted once a run

    def _regions(self, p: Pass, sites: dict[str, list],
                 require_sites: bool = True) -> tuple[list[tuple[GraphSlot, Region]] | None, str]:
        found: list[tuple[GraphSlot, Region]] = []
        for slot in self.cap.slots:
            if slot.candidate is None or slot.calls == 0:  # a graph the step no longer runs
                continue
            regions = find_regions(slot.kept, slot.candidate, sites[slot.name], p.name, slot.name,
                                   require_sites)
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
        overlay = self._region_overlay()
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
        """A decided signature under objective="memory" (rewriter.decide.memory.decide_held): the
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

    def _not_in_precision(self, p: Pass) -> str | None:
        """Why ``p`` is not tried in the precision the graphs run in now, or None; noted in
        ``_set_aside_for_precision``, so that a speculated precision pass not kept has it
        decided again at full precision."""
        if p.full_precision_only and (dtype := self._precision()) is not None:
            self._set_aside_for_precision = self._set_aside_for_precision | {p.name}
            return f"rewrites fp32 ops only; the graphs run in {dtype} now (the precision pass)"
        return None

    def _no_fresh_pages(self, p: Pass) -> str | None:
        """Why ``p``, which saves only fresh pages, is not tried: the user's step maps fewer than
        FRESH_PAGES in each run counted (:meth:`_fresh_heap`); None where it maps them, or where
        the host does not count page faults (then its regions are measured)."""
        if not p.saves_fresh_pages_only or self._fresh_heap() or host_page_faults() is None:
            return None
        return (f"saves only the host pages a step maps afresh, and the step maps fewer than "
                f"{FRESH_PAGES} in each of up to {STEP_TRIES} warm runs")

    def _decide_signature(self, p: Pass, sig: str, members: list[tuple[GraphSlot, Region]],
                          values: dict[str, dict[str, Recorded]], overlay: Any, key: str,
                          known: dict | None) -> dict:
        """Verify a sample of the signature's sites, then decide it: from ``known`` (its
        knowledge-base row, :meth:`_known_row`) when there is one, else by measuring (and
        store the figures under ``key``)."""
        first = members[0][1]
        first_values = self._values(values, members[0][0], first)
        row = _row_head(sig, members, dtype_of_region([v.value for v in first_values]))
        if known is None and self._out_of_time():
            # before verifying: a float64 run of a large region (an LM head's) costs seconds
            # the decisions still to come would spend better
            row.update(status="not reached", reason="the time budget ran out before measuring it")
            return row
        if known is None and (too_long := self._cannot_finish(p, first, overlay)):
            row.update(status="not reached", reason=too_long)
            return row
        with self._phase("verify"):
            worst = Comparison(True)
            sample = _verify_sample(members)
            for slot, r in sample:
                c = verify_region(r, self._values(values, slot, r), self.job.training,
                                  self._forms(r, overlay), precision=self.job.dtype)
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
        if too_long := self._cannot_finish(p, first, overlay):  # the verification took its time
            row.update(status="not reached", reason=too_long)
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
                               forms=self._forms(r, overlay), deadline=self.decide_by,
                               original_seconds=None if once_ms is None else once_ms / 1e3,
                               fresh_heap=self._fresh_heap(), forward_only=self._forward_only(p))
        keep, reason = decide(m, self.settings.min_speedup, self.settings.gate.noise_widths)
        if self._forward_only(p):
            reason = f"{reason}; forward only, its backward the original's"
        keep, reason = self._negligible(keep, reason, m.saved_ms * _calls(members))
        figures = m.to_dict()  # finite figures or None (no pair: a warm-up the budget cut short)
        saved = saved_ms(figures)
        row.update(kept=keep, status="kept" if keep else "rejected", source="measured",
                   reason=reason, speedup=figures["speedup"], noise=figures["noise"],
                   measurement=figures, region_ms_before=figures["baseline_ms"],
                   region_ms_after=figures["candidate_ms"],
                   saved_ms_per_step=None if saved is None else saved * _calls(members))
        if m.storable(self.settings.gate.min_pairs):
            self.settings.knowledge_base.put(key, {**figures, "pass": p.name, "example": first.label,
                                                   "ran_in": row["ran_in"]})
        return row

    def _fresh_heap(self) -> bool:
        """Whether region samples start from a trimmed heap: the user's step, a warm forward
        and backward on the host, maps fresh pages in one of up to ``STEP_TRIES`` runs
        (rewriter.decide.fresh_heap); counted once a run."""
        if self._fresh_heap_answer is None:
            job = self.job
            fresh = False
            if job.backend.name == "cpu":  # the host heap: a device's tensors are not on it
                with self._phase("measure"):
                    fresh = bool(step_maps_fresh_pages(job.forward_backward(job.model), tries=STEP_TRIES))
                self.snapshot.restore()
            self._fresh_heap_answer = fresh
        return self._fresh_heap_answer

    def _forward_only(self, p: Pass) -> bool:
        """Whether ``p``'s regions are timed without their backward (``Pass.same_backward``)."""
        return self.job.training and p.same_backward

    def _region_key(self, p: Pass, r: Region, precision: str | None) -> str:
        extra = {**self.job.backend.knowledge_key(), "region timing": REGION_TIMING,
                 "heap": "trimmed" if self._fresh_heap() else "as it runs"}
        if self._forward_only(p):  # its figures are a forward's, not to be read as the whole's
            extra["timed"] = "forward only"
        if precision is not None:  # both forms were timed with the precision pass's casts in
            extra["precision passes"] = ",".join(f"{q.name} v{q.version}" for q in self.passes
                                                 if q.sets_precision)
        return entry_key(r.signature_text(self.job.backend.name, mode_of(self.ctx), p.version,
                                          precision), extra)

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
        once = self._scanned_ms(r) if overlay is None else None  # timed in the scan (hot_first)
        if once is None:
            with self._phase("measure"):
                once = original_ms(r, values, self.job.training, clock=self.clock,
                                   forms=self._forms(r, overlay))
        return self._negligible_original(once, sites), once

    def _cannot_finish(self, p: Pass, r: Region, overlay: Any) -> str:
        """Why the region is not compared at all ("" when it is): the budget has less left
        than its comparison's fewest pairs need at the least, as far as the scan's timing of
        one call tells (:func:`least_measuring_seconds`), so the seconds go to the decisions
        still to come."""
        once = self._scanned_ms(r) if overlay is None else None
        if once is None or self.decide_by is None:
            return ""
        left = self.decide_by - time.perf_counter()
        need = least_measuring_seconds(once / 1e3, self.settings.gate, p.saves_at_most,
                                       self._forward_only(p))
        if need <= left:
            return ""
        return (f"the time budget ran out before measuring it: {max(left, 0.0):.1f} s left, its "
                f"fewest pairs need at least {need:.1f} s ({once:.0f} ms a call)")

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

    def _region_overlay(self) -> Any:
        """The precision a region runs in, as casts written into it (None: as captured): the
        kept precision pass, or, while the other passes are decided in it speculatively, the
        one to come. The recording run ran in it, so a region's recorded values are in it."""
        precise = self.kept + ([KeptPass(q) for q in self.passes if q.sets_precision]
                               if getattr(self, "_speculative", False) else [])
        return overlay_for(precise, dataclasses.replace(self.ctx, region=True))

    @staticmethod
    def _forms(r: Region, overlay: Any) -> tuple[Any, Any] | None:
        return (overlay(r.before), overlay(r.after)) if overlay is not None else None

    def _record(self, regions: list[tuple[GraphSlot, Region]]) -> dict[str, dict[str, Recorded]] | None:
        """One run of the model as it now runs, recording the boundary values of ``regions``
        (None when a graph one of them is in did not run). The scan's recording of every pass's
        regions (rewriter.decide.hot_first) serves while the model runs as it did then."""
        scanned = self._scan_values
        if scanned is not None and scanned[0] == self._runs_as() and all(
                n in scanned[1].get(slot.name, {}) for slot, r in regions for n in r.inputs):
            return scanned[1]
        names: dict[str, set[str]] = defaultdict(set)
        for slot, r in regions:
            names[slot.name].update(r.inputs)
        pending = set(names)
        # The run ends once every graph has recorded (a block graph records at its first call:
        # the other layers would only run), so recording costs the same at any depth. Not under
        # FSDP2, whose per-iteration state a forward cut short would leave mid-forward.
        stop_early = not fsdp2_modules(self.job.model)

        def recorded(name: str) -> None:
            pending.discard(name)
            if stop_early and not pending:
                raise RecordingDone

        recorders = {}
        for slot in self.cap.slots:
            if slot.name in names:
                slot.recorder = recorders[slot.name] = Recorder(
                    names[slot.name], then=functools.partial(recorded, slot.name))
        try:
            torch.manual_seed(VERIFY_SEED)
            grad = torch.enable_grad() if self.job.training else torch.no_grad()
            with switched(self.cap.switch, deterministic=True), grad:
                self.job.call(self.cap)
        except RecordingDone:
            pass
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

    def _runs_as(self) -> tuple:
        """What the model runs as: the kept rewrites and a speculative precision."""
        return tuple(id(kp) for kp in self.kept), bool(getattr(self, "_speculative", False))

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


# Sites of one signature are one region at one shape: a few of them (first, middle, last: the
# depths whose activations differ most) are verified against float64, not every layer, so
# verifying costs the same at any depth. The composed model is verified whole afterwards
# (rewriter.decide.confirm), and a failure there rolls the rewrites back.
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
