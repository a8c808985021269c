"""Which pass to measure first: the one whose original regions take the most time, as an
engineer takes the hottest operators first, so a short time budget is spent where the most can
be saved.

Passes are tried one after another, each on the graphs with the earlier ones' kept rewrites in,
and the time budget can run out before the last. In registration order a pass with little at
stake can spend it first: a LLaMA-style model with a 32 000-word vocabulary, ``steps=100``
(2-core Xeon without AMX, `.diag` run): the QKV, attention and RMSNorm regions (~1-5 ms each)
used the budget, and the loss (115 ms, 3.4x when measured) was "not reached" in one run of two.
So every pass's sites are found first (cheap), the boundary values of all their regions are
recorded in one run, and one call of each original region (the fastest of three, or one call
of 50 ms or more; one region per signature) times the calls a step makes of it, times the
share of it the pass can save at most (``Pass.saves_at_most``: 1 unless its replacement keeps
the region's main work), is what the pass can act on; the passes are measured in that order,
largest first::

    order = hot_first(keys, potential, touches)

The times are kept for the decisions (:meth:`HotFirst._scanned_ms`), so nothing is timed twice.
Without a recording (a graph the run did not reach), the regions' tensor bytes stand in.
A pass never overtakes an earlier one whose regions share a node with its own (the two compose
in the registered order: the later one is built on the earlier one's rewrite), nor one whose
reach is unknown (nodes written in place). A pass measured on the whole step because it changes
nodes no site accounts for is ordered by all it changes (``find_regions(require_sites=False)``):
held at its registered place, the loss (~115 ms a step of the same LLaMA, when its dropped
upcast was not yet its site's) waited behind the three block passes it shares no node with,
and the budget ran out before it (".diag" run, fp32, the Xeon with AMX).
Passes without sites are decided first, as registered (on the graphs they were scanned on:
their reasons are unchanged).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Hashable, Sequence

from torch.fx import GraphModule

from rewriter.capture.ir import tensor_info
from rewriter.decide.site_gate import original_ms

log = logging.getLogger("rewriter.progress")


def region_bytes(gm: GraphModule) -> int:
    """Bytes a region's calls read from and write to tensors (known shapes only)."""
    total = 0
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        for v in (n, *n.all_input_nodes):
            info = tensor_info(v)
            if info is not None and all(isinstance(d, int) for d in info.shape):  # not symbolic
                total += math.prod(info.shape) * info.dtype.itemsize
    return total


def hot_first(names: Sequence[Hashable], potential: dict[Any, float | None],
              touches: dict[Any, set[Any]]) -> list[Any]:
    """``names`` (registration order) reordered: at each step, of the passes no earlier
    remaining one holds back (an unknown ``potential`` (None) or a shared node in ``touches``),
    the one with the largest potential; ties keep registration order."""
    remaining, order = list(names), []
    while remaining:
        def held_back(i: int) -> bool:
            p = remaining[i]
            return any(potential[q] is None or potential[p] is None or touches[q] & touches[p]
                       for q in remaining[:i])
        ready = [p for i, p in enumerate(remaining) if not held_back(i)]
        best = max(ready, key=lambda p: potential[p] or 0.0)  # the first of equals
        order.append(best)
        remaining.remove(best)
    return order


class HotFirst:
    """Run's methods that scan the passes for their sites and order them (:func:`hot_first`)."""

    def _hot_first(self: Any, passes: list[Any]) -> tuple[list[Any], list[Any]]:
        """(passes decided at once: not applicable or no sites; the others, hottest first)."""
        at_once, scanned, found = [], [], []
        self._scanned, self._scan_values = {}, None
        for p in passes:
            if p.applies_to(self.ctx) is not None:
                at_once.append(p)
                continue
            try:
                sites = {slot.name: slot.try_pass(p, self.ctx) for slot in self.cap.slots}
            except Exception:  # noqa: BLE001 (its own decision reports it)
                sites = None
            if sites is not None and not any(sites.values()):
                at_once.append(p)
                self._reject_all()
                continue
            # what it changes, sites or not: the order's figure, not its decision's regions
            regions = self._regions(p, sites, require_sites=False)[0] \
                if sites is not None and p.scope == "site" else None
            self._reject_all()
            self.ctx.declined.clear()
            scanned.append(p)
            found.append(None if regions is None else _one_per_signature(regions))
        try:
            potential, touches = self._potentials(found)
            potential = {k: None if v is None else v * scanned[k].saves_at_most
                         for k, v in potential.items()}
        except Exception as e:  # noqa: BLE001 (an order is a saving of time, never a failure)
            log.info("rewriter: passes measured as registered: %s: %s", type(e).__name__, e)
            return at_once, scanned
        finally:
            self.snapshot.restore()  # the recording run: as every decision leaves the model
        order = hot_first(list(range(len(scanned))), potential, touches)
        if self._scan_values is not None:
            log.info("rewriter: measuring hottest first (ms a step each can act on): %s", ", ".join(
                f"{scanned[k].name} {'?' if potential[k] is None else f'{potential[k]:.1f}'}" for k in order))
        return at_once, [scanned[k] for k in order]

    def _potentials(self: Any, found: list[Any]) -> tuple[dict[int, float | None], dict[int, set[Any]]]:
        """Per scanned pass: ms a step of its original regions (bytes without a recording;
        None: not local), and the kept-graph nodes its regions read, replace or hand on."""
        potential: dict[int, float | None] = {}
        touches: dict[int, set[Any]] = {}
        if len(found) < 2:  # nothing to order
            return {k: 0.0 for k in range(len(found))}, {k: set() for k in range(len(found))}
        firsts = [(slot, r) for groups in found if groups for _, slot, r, _ in groups]
        values, overlay = None, self._region_overlay()
        # one time per original region (scan_key), another pass's over the same nodes reused;
        # kept for the decisions (_scanned_ms) where taken in the precision they run in
        timed: dict[tuple, float] = self._scanned if overlay is None else {}
        if firsts and not self._out_of_time():
            with self._phase("record"):
                values = self._record(firsts)
            # held for the decisions while the model runs as recorded (the first one's, at
            # least): not recorded twice
            self._scan_values = None if values is None else (self._runs_as(), values)
        for k, groups in enumerate(found):
            if groups is None:
                potential[k], touches[k] = None, set()
                continue
            touches[k] = {(slot.name, name) for _, slot, r, _ in groups
                          for name in (*r.inputs, *r.anchors, *r.outputs,
                                       *(n.name for n in r.before.graph.nodes
                                         if n.op not in ("placeholder", "output")))}
            if values is None:
                potential[k] = float(sum(region_bytes(r.before) * calls for _, _, r, calls in groups))
                continue
            with self._phase("measure"):
                ms = 0.0
                for key, slot, r, calls in groups:
                    # in the precision the values were recorded in (a bf16 value into the fp32
                    # region: GPT-2's attention raised, and every pass went as registered)
                    once = timed.get(key)
                    if once is None:
                        once = timed[key] = original_ms(r, self._values(values, slot, r), self.job.training,
                                                        clock=self.clock, forms=self._forms(r, overlay))
                    ms += once * calls
            potential[k] = ms
        return potential, touches

    def _scanned_ms(self: Any, r: Any) -> float | None:
        """One call of region ``r``'s original, in ms, as the scan timed a region like it (the
        same original structure and boundary; at the precision it was captured in)."""
        return self._scanned.get(scan_key(r))


def scan_key(r: Any) -> tuple:
    """What makes two regions' originals time alike: the original form's structure and its
    boundary, whichever pass cut it out (an LM head's Linear: onednn_linear's and
    reuse_linear_output's region, timed once, ~0.2 s of a cold optimize())."""
    return r.before_structure, tuple(r.boundary)


def _one_per_signature(regions: list[Any]) -> list[tuple[tuple, Any, Any, int]]:
    """(key, slot, first region, the calls a step makes of all its regions) per scan key."""
    groups: dict[tuple, list[Any]] = {}
    for slot, r in regions:
        groups.setdefault(scan_key(r), []).append((slot, r))
    return [(key, *members[0], sum(slot.calls for slot, _ in members)) for key, members in groups.items()]
