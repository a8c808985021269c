"""What the step check (rewriter.decide.confirm) and the compile decision (rewriter.decide.compile_gate) read
from the run that owns them: a Protocol, so neither imports rewriter.pipeline, which builds
them with its ``Run``::

    class Confirmation:
        def __init__(self, owner: RunView) -> None: ...
"""
from __future__ import annotations

import contextlib
from typing import Any, Protocol


class RunView(Protocol):
    """The parts of ``rewriter.pipeline.Run`` a decision after the passes uses."""

    job: Any  # rewriter.decide.job.Job: the model, inputs, step, backend
    settings: Any  # rewriter.pipeline.Settings
    report: Any  # rewriter.report.Report
    cap: Any  # the capture (rewriter.capture.front_ends / rewriter.capture.regional)
    kept: list  # the kept passes, in order (rewriter.decide.kept.KeptPass)
    ctx: Any  # the passes' PassContext (rebuilding a graph with some kept passes)
    units: list  # the kept decisions (rewriter.decide.confirm.KeptUnit)
    fused_opt: Any  # the fused optimizer decision, or None
    snapshot: Any  # restores the model, optimizer and RNG after each measured run
    reference: Any  # the original model's numerics
    clock: Any
    deadline: float | None
    step_seconds: float  # one original step, as timed at the reference run
    dispatch_ms: float  # a regional generation's installed-graph cost a step (0: none measured)
    compiled: dict | None
    compile_plan: dict | None
    compiled_first: Any  # the compile decided first and not kept (rewriter.decide.compile_first), or None

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]: ...

    def _confirm_reserve(self) -> float: ...

    def confirmation_key(self) -> str: ...

    def _step_entry_key(self, what: dict) -> str: ...

    def _verify_candidate(self, composed: bool = False) -> tuple[bool, str, float | None]: ...

    def rebuild(self, kept: list) -> None: ...

    def composed_step(self) -> Any: ...

    def original_step(self) -> Any: ...

    def _on_new_graph(self, slot: Any) -> None: ...
