"""The compile candidates a CompileGate does not try, or stops, each a report row that says why:
the forms it does not offer beside the one it tries (the gate's ``_forms``; the figures behind
each choice are in the rows), a compile the run cannot repay, and one abandoned at its time
limit (rewriter.devices.compile_limit) or by an earlier run."""
from __future__ import annotations

import logging
from typing import Any

from rewriter.decide.amortize import MAX_SAVING, Payback, predict_compile_seconds
from rewriter.decide.compile_size import compile_nodes, repeated_nodes
from rewriter.decide.gate import saved_ms
from rewriter.report import Decision

log = logging.getLogger("rewriter.progress")

NAME = "compile"  # the compile's decision rows' pass_name (the gate's and these)
RETRY_FACTOR = 2.0  # an abandoned compile is tried again where a run allows it this many times as long


def regional_not_offered(gate: Any, ex: Any) -> Decision | None:
    """The row for the regional compile of the bf16 graphs where the original model under
    autocast, compiled whole, is the one candidate (training, a kept bf16 precision; the
    row's figures: `benchmarks/steps_bf16.json`; the README says more)."""
    if gate._forms(ex) != (True,):
        return None
    return Decision(NAME, False, "not tried",
                    f"{ex.name} (regional, the bf16 graphs): the original model under autocast "
                    f"({gate._label(ex, True)}) is the candidate beside a kept bf16 precision, "
                    "one compile; the bf16 graphs compiled regionally lost to it on every model "
                    "measured (AMX Xeon, training: 1.22x / 1.06x / 0.98x against 1.59x / 1.30x / "
                    "1.43x over the rewritten eager step)", scope="step")


def whole_not_offered(gate: Any, ex: Any) -> Decision | None:
    """The row for the whole original model's compile where it would have been weighed but is
    not offered (``CompileGate._regional_one_candidate``): a second compile for what one trace fuses
    across the graphs' edges. GPT-2 training, 4 layers, Xeon without AMX: the whole model 4.4%
    faster than every graph regionally (0.956x ±0.006; ~2.5 ms a step the regional calls' own
    overhead), a second compile ~15 s cold; LLaMA, benchmarks.run: regional 1.17x, whole 1.15x."""
    r = gate.run
    if not (gate._weighed() and gate._regional_one_candidate()):
        return None
    cost = predict_compile_seconds(compile_nodes(r, original=True), r.job.training,
                                   repeated=repeated_nodes(r, original=True), nested=gate._nests(ex))
    return Decision(NAME, False, "not tried",
                    f"{gate._label(ex, True)}: the regional compile ({gate._label(ex, False)}) "
                    f"is the candidate; the whole model's compile (predicted {cost:.1f} s) is "
                    "not paid beside it for fusing across the graphs' edges", scope="step",
                    measurement={"predicted_compile_seconds": round(cost, 3)})


def not_worth_compiling(gate: Any, ex: Any, steps: int | None, known: dict | None,
                        predicted: tuple[float, str, int], original: bool = False) -> Decision | None:
    """A row saying why compiling is not tried, when its predicted cost (the gate's
    ``_predicted``) cannot be repaid within the run even at the best saving there is reason to
    expect (``known``: the knowledge base's entry for this compile); None: try it."""
    if steps is None:
        return None
    cost, source, nodes = predicted
    known_ms = saved_ms(known)
    if known_ms is not None:
        saving, basis = known_ms / 1e3, "the knowledge base's"
    else:
        saving, basis = MAX_SAVING * gate.run.step_seconds, f"at most {MAX_SAVING:.0%} of the step"
    p = Payback(cost, saving, steps)
    if p.repays:
        return None
    return Decision(NAME, False, "not tried",
                    f"{gate._label(ex, original)}: would not repay within the run ({source}; saving {basis}): "
                    f"{p.describe()}", scope="step",  # no sites: nothing was compiled
                    measurement={"predicted_compile_seconds": round(cost, 3), "nodes": nodes,
                                 **p.to_dict()})


def abandon_key(gate: Any, ex: Any) -> str:
    """The knowledge-base key an abandoned compile is remembered under: the executor and the
    model's class on this step (the run's ``_step_entry_key``: device, mode, precision, tensor and
    input shapes), not the graphs, the form or the kept rewrites, which a later run may capture
    or decide otherwise (Funnel, a second run in one process: one rewrite fewer kept, and two of
    nine graphs traced dynamic in a length; a key with them compiled for another 417 s). Where
    one form of a model runs away, the others are not tried."""
    model = type(gate.run.job.model)
    return gate.run._step_entry_key({"scope": "compile abandoned", "executor": ex.name,
                                     "model": f"{model.__module__}.{model.__qualname__}"})


def abandoned_before(gate: Any, ex: Any, original: bool, limit: float | None) -> Decision | None:
    """A "not tried" row where an earlier run abandoned a compile of this model
    (:func:`abandon_key`) and this run's ``limit`` is not :data:`RETRY_FACTOR` times its seconds;
    None: try it (a run that much longer tries afresh; the limit moves with the measured step
    time, so a run of the same length does not pass it by a few seconds' noise)."""
    known = gate.run.settings.knowledge_base.get(abandon_key(gate, ex))
    if not known or (limit is not None and limit >= RETRY_FACTOR * known["compile_abandoned"]):
        return None
    return Decision(NAME, False, "not tried",
                    f"{gate._label(ex, original)}: an earlier run abandoned this model's compile after "
                    f"{known['compile_abandoned']:.3g} s, past what its run could repay; "
                    + (f"this run's limit, {limit:.3g} s, is not twice that" if limit is not None else
                       "not tried again without steps= (a run long enough to repay a longer one)"),
                    scope="step", measurement={"compile_abandoned": known["compile_abandoned"]})


def abandoned(gate: Any, ex: Any, original: bool, compile_s: float, detail: str) -> Decision:
    """The row of a compile stopped at its time limit (the gate's ``_limit``), remembered in the
    knowledge base (:func:`abandon_key`), so a later run no longer than this one does not pay it again."""
    r, label = gate.run, gate._label(ex, original)
    r.settings.knowledge_base.put(abandon_key(gate, ex), {"pass": NAME, "compile_abandoned": round(compile_s, 1)})
    reason = (f"{label}: abandoned after {compile_s:.3g} s of compiling, its limit {gate._limit.seconds:.3g} s "
              f"(what the best saving repays within the first tenth of steps={gate.steps()}, or three times "
              "its prediction); the eager graphs run")
    log.warning("rewriter: compile: %s", reason)
    return Decision(NAME, False, "abandoned", reason, sites=[label], scope="step",
                    measurement={"compile_abandoned": round(compile_s, 1),
                                 "limit_seconds": round(gate._limit.seconds, 1)},
                    verification=detail)
