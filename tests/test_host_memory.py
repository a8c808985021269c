"""rewriter.keep_freed_host_memory: a step's large tensors stop landing on fresh pages.

The setting is the whole process's, so each check runs in a child process of its own.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from rewriter.devices.host_memory import INT_MAX, keep_freed_host_memory

try:
    from rewriter.devices.host_memory import _glibc
    _glibc()
    GLIBC = True
except RuntimeError:
    GLIBC = False

# 64 MiB tensors touched twice after a warm-up: above glibc's largest adaptive mmap threshold
# (32 MiB), so by default each is mapped afresh and every page faults (2 x 16384).
CHILD = textwrap.dedent("""
    import json, resource, sys, torch
    import rewriter
    def faults():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_minflt + r.ru_majflt
    def touch():
        t = torch.ones(16 << 20)
        del t
    def two():
        touch(); touch()
        f0 = faults(); touch(); touch()
        return faults() - f0
    def resident_bytes():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    out = {"default": two()}
    setting = rewriter.keep_freed_host_memory()
    # the least of a few rounds: another allocation may take part of the kept block once,
    # and the next 64 MiB then extends the heap (fresh pages, once)
    out["kept"], out["said"] = min(two() for _ in range(5)), str(setting)
    before = resident_bytes()
    setting.undo()
    out["handed_back"] = before - resident_bytes()
    print(json.dumps(out))
""")


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only (Linux)")
def test_kept_memory_is_reused_without_faults_and_undo_hands_it_back():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    pages = 2 * (64 << 20) // 4096
    assert out["default"] >= pages // 2, out   # mapped afresh each time
    assert out["kept"] < pages // 20, out       # the heap's pages, reused
    assert out["handed_back"] >= 32 << 20, out  # undo: the kept 64 MiB leaves the process
    assert "M_MMAP_MAX=0" in out["said"] and "2.0 GiB" in out["said"]


@pytest.mark.parametrize("bad", [0, -1, INT_MAX + 1, 1.5, True, "2G"])
def test_keep_bytes_out_of_range_is_refused_before_anything_is_set(bad):
    with pytest.raises(ValueError, match="keep_bytes"):
        keep_freed_host_memory(bad)


class _Libc:
    """glibc's three calls, recorded."""

    def __init__(self):
        self.set, self.trimmed = [], False

    def gnu_get_libc_version(self):
        return b"2.36"

    def mallopt(self, param, value):
        self.set.append((param, value))
        return 1

    def malloc_trim(self, pad):
        self.trimmed = True
        return 1


def test_undo_sets_back_only_what_it_set_as_the_process_started(monkeypatch):
    from rewriter.devices import host_memory as hm
    libc = _Libc()
    monkeypatch.setattr(hm, "_glibc", lambda: libc)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")  # the user's own, from the start
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.check=3")
    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    setting = keep_freed_host_memory(1 << 30)
    assert libc.set == [(hm.M_MMAP_MAX, 0), (hm.M_TRIM_THRESHOLD, 1 << 30)]
    libc.set.clear()
    setting.undo()
    # the mmap threshold and top pad (the user's too, if set) are not touched
    assert sorted(libc.set) == sorted([(hm.M_MMAP_MAX, 65536), (hm.M_TRIM_THRESHOLD, 1 << 20)])
    assert libc.trimmed


def test_the_start_values_read_the_tunable_over_its_alias_and_skip_what_is_not_a_number():
    from rewriter.devices.host_memory import M_MMAP_MAX, M_TRIM_THRESHOLD, start_values
    assert start_values({}) == {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}
    env = {"MALLOC_TRIM_THRESHOLD_": "1000", "MALLOC_MMAP_MAX_": "many",
           "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0x20:glibc.malloc.check=3"}
    assert start_values(env) == {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 32}


def test_not_glibc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(RuntimeError, match="glibc.*jemalloc or tcmalloc"):
        keep_freed_host_memory()


# --- the report's note, from the whole-step check's page faults (controlled clock) ----------

def _optimized_with_faults(original_faults):
    import torch

    import rewriter
    from tests.controlled import QUICK, ControlledClock, RewriteRelu
    from tests.models import Blocks

    def faults(call, step):  # the original whole step maps fresh pages; nothing else does
        return original_faults if step.scope == "step" and not step.passes else 3

    torch.manual_seed(0)
    clock = ControlledClock({"a": 0.5}, faults=faults)
    return rewriter.optimize(Blocks(n=2).eval(), (torch.randn(8, 16),), passes=[RewriteRelu("a")],
                             clock=clock, gate=QUICK, knowledge_base=False, compile=False,
                             profile=False, progress=False)


def test_a_step_that_maps_fresh_pages_gets_a_note_naming_the_switch():
    fast = _optimized_with_faults(9000)
    notes = [n for n in fast.report.notes if n.startswith("host memory:")]
    assert len(notes) == 1
    assert "maps 9000 fresh pages a step" in notes[0] and "the optimized step 3" in notes[0]
    assert "rewriter.keep_freed_host_memory()" in notes[0]
    assert "host memory:" in str(fast.report)  # the printed report carries it


def test_no_note_under_the_threshold_or_where_faults_are_not_counted():
    from rewriter.devices.host_memory import FRESH_PAGES_WORTH_A_NOTE, fresh_pages_note
    fast = _optimized_with_faults(FRESH_PAGES_WORTH_A_NOTE - 1)
    assert not [n for n in fast.report.notes if n.startswith("host memory:")]
    assert fresh_pages_note([], [0, 0]) is None  # a host that does not count them
    assert fresh_pages_note([9000, 10, 9000], [0, 0, 0]) is not None  # the median decides
    assert fresh_pages_note([9000, 10, 10], [0, 0, 0]) is None
