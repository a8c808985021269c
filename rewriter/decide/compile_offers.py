"""The compile forms a CompileGate does not offer beside the one it tries, each a report row
that says why (the gate's ``_forms``; the figures behind each choice are in the rows)."""
from __future__ import annotations

from typing import Any

from rewriter.decide.amortize import predict_compile_seconds
from rewriter.decide.compile_size import compile_nodes, repeated_nodes
from rewriter.report import Decision

NAME = "compile"  # the compile's decision rows' pass_name (the gate's and these)


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
