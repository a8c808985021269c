"""What a regional compile is handed: block graphs without the kept rewrites the compiler makes
itself, and the graphs outside the blocks that run one of those rewrites left as they run.

The regional compile is the one compile candidate under a regional capture (rewriter.decide.
compile_gate): it is never handed a worse input than the model's own code, so the kept rewrites
the compiler makes itself (``COMPILER_DOES_ITSELF``) are set aside in what it compiles. A graph
outside the blocks (embeddings, mask, head, loss) that runs one of them is not compiled at all:
it runs with the rewrite, as measured. Side by side over the rewritten eager step, training,
steps=20000, 2-core Xeon without AMX (`.diag` runs, one process each), the loss's graph left
eager with fuse_cross_entropy against compiled without it: LLaMA at a 32 000-word vocabulary
1.070x against 0.87x (Inductor's loss maps its [tokens, vocabulary] buffers afresh at every
step); LLaMA at 8000 words 1.127x against 1.099x, first compiled step 17.6 s against 20.0 s;
BERT 0.964x against 0.932x (rejected either way), 15.8 s against 19.0 s::

    source, superseded = compile_sources(run, aside)
    RegionalCompiled(cap, backend, source, superseded)
"""
from __future__ import annotations

from typing import Any, Callable

from rewriter.capture.regional import EAGER
from rewriter.decide.kept import apply_kept, build


def compile_sources(run: Any, aside: list[str]) -> tuple[Callable[[Any], Any], list[str]]:
    """(the graph each slot's compile gets, or EAGER; the rewrites in ``aside`` that then run
    nowhere: superseded by the compile)."""
    held = [kp for kp in run.kept if kp.name in aside]
    rest = [kp for kp in run.kept if kp.name not in aside]
    outside = {}  # slot name -> the set-aside rewrites it runs
    for slot in run.cap.slots:
        if slot.block is None:
            runs = {kp.name for kp in held if apply_kept(slot.original, kp, run.ctx, slot.name) is not None}
            if runs:
                outside[slot.name] = runs

    def source(slot: Any) -> Any:
        if slot.name in outside:
            return EAGER
        return slot._run_form(build(slot.original, rest, run.ctx, slot.name))
    still_run = set().union(*outside.values()) if outside else set()
    return source, [name for name in aside if name not in still_run]
