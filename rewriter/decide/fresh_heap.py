"""Whether the user's step maps fresh host pages, so its regions are timed from a trimmed heap.

A training step frees and allocates its large tensors every step; where glibc hands the freed
memory back to the system (its default above the mmap threshold, and when the heap's free top
grows past the trim threshold), the next step's tensors come on fresh pages, each mapped and
zeroed by the kernel. A region timed alone, over and over, instead reuses what it freed a
moment ago, or not, by the heap's history, and its figures move with it (BERT's loss region:
rewriter.decide.site_gate.heap_as_a_step_leaves_it). So one warm run of the model's forward and
backward is counted; where it maps ``FRESH_PAGES`` or more, each region sample starts from a
trimmed heap, as the step leaves it. Where the process keeps its freed memory
(rewriter.keep_freed_host_memory(), jemalloc or tcmalloc preloaded) the step maps next to none,
and the regions are timed as they run::

    fresh = step_maps_fresh_pages(fwd_bwd)   # True, False, or None where faults are not counted
"""
from __future__ import annotations

from typing import Callable

from rewriter.decide.gate import host_page_faults
from rewriter.devices.host_memory import FRESH_PAGES_WORTH_A_NOTE

# fresh pages a step maps, at least, for its regions to be timed from a trimmed heap: the
# report's own "worth a note" (20 MiB of 4 KiB pages; BERT fp32 maps 16 000-24 000)
FRESH_PAGES = FRESH_PAGES_WORTH_A_NOTE


def step_maps_fresh_pages(run: Callable[[], None],
                          faults: Callable[[], int | None] = host_page_faults,
                          at: int = FRESH_PAGES) -> bool | None:
    """Whether one call of ``run`` (a warm step) maps ``at`` fresh pages or more; None where
    the platform does not count page faults."""
    before = faults()
    run()
    after = faults()
    if before is None or after is None:
        return None
    return after - before >= at
