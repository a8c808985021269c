"""Whether the user's step maps fresh host pages, so its regions are timed from a trimmed heap.

A training step frees and allocates its large tensors every step; where glibc hands the freed
memory back to the system (its default above the mmap threshold, and when the heap's free top
grows past the trim threshold), the next step's tensors come on fresh pages, each mapped and
zeroed by the kernel. A region timed alone, over and over, instead reuses what it freed a
moment ago, or not, by the heap's history, and its figures move with it (BERT's loss region:
rewriter.decide.site_gate.heap_as_a_step_leaves_it). So up to ``STEP_TRIES`` warm runs of the
model's forward and backward are counted; where one maps ``FRESH_PAGES`` or more, each region
sample starts from a trimmed heap, as the step leaves it. One run is not enough: whether a step
maps them moves from step to step. 12 eager fp32 training steps each, 2-core AMD EPYC, fresh
pages a step from the third on: LLaMA 8000 15874 14353 38069 15025 34028 24000 0 1 15968, GPT-2
8003 15968 1 1 0 0 7010 34070 22064 22176, Qwen2 1 7794 32038 8001 1 0 1 0 15968 0; BERT's
forward and backward alone 0 1632 13120 23968 7504 34018. One counted run had said "as it
runs" for LLaMA, GPT-2 and BERT there (the fused loss then rejected on a figure the step's
own heap does not show, kept in another process). Where the process keeps its freed memory
(rewriter.keep_freed_host_memory(), jemalloc or tcmalloc preloaded) the step maps next to none,
and the regions are timed as they run::

    fresh = step_maps_fresh_pages(fwd_bwd, tries=STEP_TRIES)   # True, False, or None (not counted)
"""
from __future__ import annotations

from typing import Callable

from rewriter.decide.gate import host_page_faults
from rewriter.devices.host_memory import FRESH_PAGES_WORTH_A_NOTE

# fresh pages a step maps, at least, for its regions to be timed from a trimmed heap: the
# report's own "worth a note" (20 MiB of 4 KiB pages; BERT fp32 maps 16 000-24 000)
FRESH_PAGES = FRESH_PAGES_WORTH_A_NOTE
# warm forward-and-backward runs counted, at most: a step that maps them in one of three does
# so in a good share of its steps (the module's figures), and a region's original mapping them
# in a share of steps costs the step that share of its fresh pages
STEP_TRIES = 3


def step_maps_fresh_pages(run: Callable[[], None],
                          faults: Callable[[], int | None] = host_page_faults,
                          at: int = FRESH_PAGES, tries: int = 1) -> bool | None:
    """Whether a call of ``run`` (a warm step) maps ``at`` fresh pages or more, in any of
    ``tries`` calls (stops at the first that does); None where the platform does not count
    page faults."""
    for _ in range(tries):
        before = faults()
        run()
        after = faults()
        if before is None or after is None:
            return None
        if after - before >= at:
            return True
    return False
