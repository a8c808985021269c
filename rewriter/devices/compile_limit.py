"""A time limit on one compile: a compile still running when the run could no longer repay it
is abandoned, and the eager graphs run.

Inductor's compile of one graph can run for many minutes: Funnel's pooled block, training, torch
2.13, the 2-core AMD EPYC: its backward's kernel tiling simplified index expressions in sympy
(``TilingSelect`` -> ``simplify_index_in_vec_range``) for more than nine minutes, stopped by
hand, where the other families' whole compiles took 6-25 s. Nothing in the compile can be asked
to stop, so the limit is a ``SIGALRM`` timer whose handler raises :class:`CompileOverran` in the
main thread, between two Python bytecodes of whatever the compile runs then; the exception
leaves the compile like any error a backend raises (the compile gate's "raised" path: the runner
dropped, the model's state restored, the eager graphs run)::

    try:
        with CompileLimit(120.0) as limit:
            step()               # the compiled form's first step: where it compiles
    except CompileOverran:
        ...                      # limit.overran: stopped at 120 s

The timer is set only in the main thread of a platform with ``setitimer`` and only where no
other timer is running (the caller's own ``SIGALRM`` is left alone); otherwise the compile runs
unlimited, as before. The alarm fires once: a compile that catches and drops the exception runs
on to its end, and ``overran`` still says it went past its limit (the gate drops it).
"""
from __future__ import annotations

import signal
import threading
from typing import Any


class CompileOverran(RuntimeError):
    """Raised into a compile that has run past its :class:`CompileLimit`."""


class CompileLimit:
    """Stops what runs inside it after ``seconds`` (None: no limit) by raising
    :class:`CompileOverran`; :attr:`overran` says whether it did, :attr:`armed` whether the timer
    could be set."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.overran = False
        self.armed = False
        self._previous: Any = None

    def _can_arm(self) -> bool:
        return (self.seconds is not None and self.seconds > 0 and hasattr(signal, "setitimer")
                and threading.current_thread() is threading.main_thread()
                and signal.getitimer(signal.ITIMER_REAL)[0] == 0)  # no one else's timer running

    def _on_alarm(self, signum: int, frame: Any) -> None:
        self.overran = True
        raise CompileOverran(f"still compiling after {self.seconds:.0f} s, the limit this run "
                             "sets (rewriter.decide.amortize.compile_time_limit)")

    def __enter__(self) -> CompileLimit:
        self.overran = False
        self.armed = self._can_arm()
        if self.armed:
            self._previous = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.armed:
            return
        try:  # the alarm may fire here, before the timer is cleared: the handler goes back anyway
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, self._previous)
            self.armed = False
