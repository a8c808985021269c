"""How much a compile is handed, in graph calls: what its cost is predicted from
(:func:`rewriter.decide.amortize.predict_compile_seconds`)::

    nodes = compile_nodes(run)                  # the graphs as they now run, each once
    nodes = compile_nodes(run, original=True)   # the original model compiled whole
    again = repeated_nodes(run, original=True)  # of those, the blocks' later instances
"""
from __future__ import annotations

from typing import Any

from rewriter.decide.run_view import RunView


def compile_nodes(run: RunView, original: bool = False, set_aside: bool = False) -> int:
    """Calls in the graphs the compiler gets: every graph the step runs, once (a regional
    capture's block graph serves all its instances; the rewritten graphs when rewrites are
    kept, else the original ones); the original model compiled whole beside kept rewrites:
    every graph as often as it runs in a step (its trace unrolls the blocks); a generation
    with nothing kept: one call's share of that. ``set_aside``: the regional compile with
    kept rewrites set aside (counted on the original graphs)."""
    gen = run.job.generation
    if gen is not None and not run.kept and not original:
        # a generation compiles its decode call's forward, whole (CompiledForward), whatever
        # the capture: the step unrolls the prefill and each decode call, traces of about
        # one size (graphs the step does not run, a whole capture's warm-up, count nothing)
        unrolled = sum(s.calls * calls_in(s.original) for s in run.cap.slots if s.calls > 0)
        return round(unrolled / (1 + gen.decode_calls))
    if original:
        return sum(max(s.calls, 1) * calls_in(s.original)
                   for s in run.cap.slots if s.calls or s.block is None)
    return sum(calls_in(s.kept_run if run.kept and not set_aside else s.original)
               for s in run.cap.slots if s.calls or s.block is None)


def repeated_nodes(run: RunView, original: bool = False) -> int:
    """Of :func:`compile_nodes`' calls, those in a graph's second and later runs of a step: the
    original model compiled whole traces each block instance again (its trace unrolls them),
    and Inductor builds each distinct kernel once, so those cost tracing and lowering, not
    building (:data:`rewriter.decide.amortize.REPEATED_NODE_FACTOR`). Every other form hands the
    compiler each graph once: 0."""
    if not original:
        return 0
    return sum((s.calls - 1) * calls_in(s.original) for s in run.cap.slots if s.calls > 1)


def calls_in(gm: Any) -> int:
    """A graph's calls (its nodes that compute)."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
