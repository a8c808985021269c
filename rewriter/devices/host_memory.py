"""Keep freed host memory in the process (glibc malloc), so a step does not map fresh pages.

glibc hands a large freed block back to the system: one above its mmap threshold (which adapts,
up to 32 MiB) is unmapped at once, and a heap whose free top exceeds the trim threshold is
trimmed. The next step then allocates the same tensors on fresh pages, and the kernel zeroes
each page on first touch. How often that happens depends on the process's history, so the
same step moves from run to run: LLaMA with a 32 000-word vocabulary, training, 2-core Xeon,
eager 120 000-170 000 page faults a step; one [1024, 32 000] fp32 matmul output 76 ms on fresh
pages, 53 ms on kept ones (``.diag/logits_buf.py``). ``optimize()`` keeps the buffers of its own
kernels (the fused loss's gradient, a large Linear's output: ``reuse_linear_output``); the
rest belongs to the process's allocator, which ``optimize()`` never changes on its own: this
is the user's switch, for the whole process::

    setting = rewriter.keep_freed_host_memory()   # once, at the start of training
    print(setting)    # glibc malloc: nothing mapped on its own (M_MMAP_MAX=0), ...
    setting.undo()    # the two parameters as the process started, the kept memory handed
                      # back (its adaptive mmap threshold stays off: glibc has no switch back)

The cost: memory the process frees stays with it (its resident size stays near its peak)
until it exits or undoes it. The same at process start, without code: ``MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=<bytes above the step's peak>`` in the environment (no 2 GiB limit there),
or jemalloc/tcmalloc preloaded (``LD_PRELOAD``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import statistics
import sys
from dataclasses import dataclass

# glibc <malloc.h>
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
# What keep_freed_host_memory sets, and where glibc took each from at process start (its
# environment variable, its tunable, else its initial value on 64-bit): what undo() sets back
SET = {M_MMAP_MAX: ("MALLOC_MMAP_MAX_", "glibc.malloc.mmap_max", 65536),
       M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold", 128 * 1024)}
INT_MAX = 2**31 - 1  # mallopt takes a C int
DEFAULT_KEEP = INT_MAX
# fresh pages a step worth saying so (each a page mapped and zeroed, 4 KiB on x86: 0.7 us
# on the 2-core Xeon, ~3 us on a 2-core EPYC, so 5000 is 4-15 ms)
FRESH_PAGES_WORTH_A_NOTE = 5000


@dataclass
class HostMemorySetting:
    """What :func:`keep_freed_host_memory` set, readable; ``undo()`` sets it back."""
    keep_bytes: int
    glibc: str

    def __str__(self) -> str:
        return (f"glibc {self.glibc} malloc: nothing mapped on its own (M_MMAP_MAX=0); freed heap "
                f"kept up to {self.keep_bytes / 2**30:.1f} GiB (M_TRIM_THRESHOLD)")

    def undo(self) -> None:
        """The two parameters it set back to the process's start values (glibc's initial
        values, or the ``MALLOC_*_`` variables / ``GLIBC_TUNABLES`` the process started with),
        and the memory kept so far handed back (``malloc_trim``: the free pages inside the
        heap too, not only its top). The mmap threshold stays where glibc's adaptation had
        taken it (any mallopt stops the adaptation; glibc has no switch back)."""
        libc = _glibc()
        for param, value in start_values().items():
            libc.mallopt(param, value)
        libc.malloc_trim(0)


def start_values(environ: dict[str, str] | None = None) -> dict[int, int]:
    """What glibc set the parameters in :data:`SET` to at process start: the tunable
    (``GLIBC_TUNABLES=glibc.malloc.trim_threshold=...:...``, which glibc 2.36 applies over its
    alias), else the environment variable, else the initial value; a value that does not
    read as a number counts as absent."""
    env = os.environ if environ is None else environ
    tunables = dict(item.split("=", 1) for item in env.get("GLIBC_TUNABLES", "").split(":") if "=" in item)
    values = {}
    for param, (variable, tunable, initial) in SET.items():
        values[param] = initial
        for text in (env.get(variable), tunables.get(tunable)):  # the tunable wins
            try:
                values[param] = int(text, 0) if text is not None else values[param]
            except ValueError:
                pass
    return values


def keep_freed_host_memory(keep_bytes: int = DEFAULT_KEEP) -> HostMemorySetting:
    """From now on this process keeps up to ``keep_bytes`` of freed host memory for reuse
    instead of returning it to the system (glibc malloc, Linux). Raises ``ValueError`` for a
    ``keep_bytes`` out of range, ``RuntimeError`` where the C library is not glibc or refuses."""
    if isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int) or not 0 < keep_bytes <= INT_MAX:
        raise ValueError(f"keep_bytes must be an int in 1..{INT_MAX} (mallopt takes a C int; for "
                         f"more, set MALLOC_TRIM_THRESHOLD_ before the process starts), got {keep_bytes!r}")
    libc = _glibc()
    version = libc.gnu_get_libc_version().decode()
    # not M_TOP_PAD: it would grow the heap by keep_bytes at every extension (address space
    # that a strict overcommit policy may refuse)
    for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, keep_bytes)):
        if libc.mallopt(param, value) != 1:
            raise RuntimeError(f"glibc {version} refused mallopt({param}, {value})")
    return HostMemorySetting(keep_bytes, version)


def pages_mib(pages: float) -> float:
    """MiB of ``pages`` host pages (this machine's page size)."""
    return pages * mmap.PAGESIZE / 2**20


def fresh_pages_note(original: list[int], optimized: list[int],
                     at: int = FRESH_PAGES_WORTH_A_NOTE) -> str | None:
    """The report's note when the original step maps ``at`` or more fresh pages a step (the
    median of the whole-step check's samples: ``original`` and ``optimized`` page faults);
    None below it or where the host does not count them."""
    if not original or not optimized:
        return None
    before, after = statistics.median(original), statistics.median(optimized)
    if before < at:
        return None
    return (f"host memory: the original step maps {before:.0f} fresh pages a step "
            f"({pages_mib(before):.0f} MiB, the step check's median; the optimized step "
            f"{after:.0f}): freed tensors go back to "
            "the system and come back as pages the kernel zeroes. rewriter.keep_freed_host_memory() "
            "keeps them in the process (the whole process's allocator, so optimize() leaves it "
            "to you)")


def trim_heap() -> None:
    """Hand this process's free heap pages back to the system (glibc ``malloc_trim(0)``), as a
    training step's own frees leave the heap: the next large allocations map fresh pages. A
    no-op where the C library is not glibc. Costs microseconds when there is nothing to hand
    back; what it costs after is the fresh pages, which the caller means to time."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = _glibc().malloc_trim
        except (RuntimeError, OSError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None  # glibc's malloc_trim once found; False where there is none


def _glibc() -> ctypes.CDLL:
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"keep_freed_host_memory sets glibc's malloc (Linux); this is {sys.platform}: "
                           "preload jemalloc or tcmalloc instead")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        raise RuntimeError("the C library is not glibc (no gnu_get_libc_version/mallopt/malloc_trim): preload "
                           "jemalloc or tcmalloc, or set its own options")
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    return libc
