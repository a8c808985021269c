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

In the main thread of a platform with ``setitimer``, where no other timer is running, the limit
is that alarm (a signal also ends a blocking wait of the main thread, Inductor's on its compile
workers). Elsewhere (optimize() called from another thread, or under the caller's own
``SIGALRM`` timer, e.g. pytest-timeout's signal method, which is left alone) a timer thread raises
the same exception into the compiling thread as an asynchronous exception (CPython's
``PyThreadState_SetAsyncExc``), delivered between two of its bytecodes once a blocking call
returns; one that fired as the compile ended lands on leaving, inside the limit, and is dropped
there (``overran`` says it fired; withdrawing it through the C API instead would leave the
interpreter's eval breaker set for good: torch.profiler's ``with_stack`` then hung at 100 % CPU
in its next start, torch 2.13, CPython 3.11). Without either (another
Python), the compile runs unlimited, as before. The limit fires once: a compile that catches and
drops the exception runs on to its end, and ``overran`` still says it went past its limit (the
gate drops it).
"""
from __future__ import annotations

import ctypes
import platform
import signal
import threading
from typing import Any


class CompileOverran(RuntimeError):
    """Raised into a compile that has run past its :class:`CompileLimit`."""


def _async_raiser() -> Any:
    """CPython's ``PyThreadState_SetAsyncExc`` (None elsewhere): raise an exception in another
    thread. Never called with NULL to withdraw one: that leaves the eval breaker set (module)."""
    if platform.python_implementation() != "CPython":
        return None
    return getattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", None)


_SET_ASYNC_EXC = _async_raiser()


class CompileLimit:
    """Stops what runs inside it after ``seconds`` (None: no limit) by raising
    :class:`CompileOverran`; :attr:`overran` says whether it did, :attr:`armed` how the limit
    could be set (``"alarm"``, ``"thread"``, or ``""``: not at all)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.overran = False
        self.armed = ""
        self._previous: Any = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._target = 0     # the thread the limit raises into ("thread")
        self._done = False   # left: a late timer raises nothing

    def _how(self) -> str:
        if self.seconds is None or self.seconds <= 0:
            return ""
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread() \
                and signal.getitimer(signal.ITIMER_REAL)[0] == 0:  # no one else's timer running
            return "alarm"
        return "thread" if _SET_ASYNC_EXC is not None else ""

    def _message(self) -> str:
        return (f"still compiling after {self.seconds:.3g} s, the limit this run sets "
                "(rewriter.decide.amortize.compile_time_limit)")

    def _on_alarm(self, signum: int, frame: Any) -> None:
        self.overran = True
        raise CompileOverran(self._message())

    def _on_timer(self) -> None:
        message = self._message()

        class Overran(CompileOverran):  # raised from its class alone: the message comes with it
            def __init__(self, *args: Any) -> None:
                super().__init__(message)
        Overran.__name__ = Overran.__qualname__ = "CompileOverran"
        with self._lock:
            if not self._done:
                self.overran = True
                _SET_ASYNC_EXC(ctypes.c_ulong(self._target), ctypes.py_object(Overran))

    def __enter__(self) -> CompileLimit:
        self.overran, self._done = False, False
        self.armed = self._how()
        if self.armed == "alarm":
            self._previous = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        elif self.armed == "thread":
            self._target = threading.get_ident()
            self._timer = threading.Timer(self.seconds, self._on_timer)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.armed == "alarm":
            try:  # the alarm may fire here, before the timer is cleared: the handler goes back anyway
                signal.setitimer(signal.ITIMER_REAL, 0)
            finally:
                signal.signal(signal.SIGALRM, self._previous)
        elif self.armed == "thread":
            with self._lock:
                self._done = True
                self._timer.cancel()
            if self.overran:  # fired: its exception, if still pending, lands here, not later
                _land_pending()
        self.armed = ""


def _land_pending() -> None:
    """Run a few bytecodes where a pending :class:`CompileOverran` is raised, and drop it."""
    try:
        for _ in range(100):  # each backward jump checks for an asynchronous exception
            pass
    except CompileOverran:
        pass
