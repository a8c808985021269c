"""Capturing the model for a run: regional, fx or Dynamo, checked against the model before any
pass runs (a mismatch falls back to the next front-end). A mixin of
:class:`rewriter.pipeline.Run`.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from rewriter.capture.blocks import calls_in_one_forward, find_blocks
from rewriter.capture.front_ends import Capture, DynamoCapture, FxCapture, capture
from rewriter.capture.regional import RegionalCapture
from rewriter.decide.job import switched
from rewriter.decide.verify import compare_runs, tolerance_for
from rewriter.errors import CaptureError

log = logging.getLogger("rewriter.progress")


class CaptureStage:
    """Run's methods that capture the model and check the capture."""

    # --- capture -----------------------------------------------------------------------------
    def _checked_capture(self) -> Capture:
        """Capture, and check the captured model computes what the model does (else fall back)."""
        job, front_end = self.job, self.settings.front_end
        log.info("rewriter: capturing %s (%s step)", type(job.model).__name__, job.mode)
        cap = self._regional_capture()
        checked = False  # a regional capture is checked (and its graphs' calls counted) once
        if cap is not None:
            problem = self._capture_mismatch(cap)
            checked = not problem
            if problem:
                cap.remove()
                log.info("rewriter: the regional capture differs from the model (%s); capturing "
                         "the whole model", problem)
                self.report.notes.append(f"regional capture differs from the model ({problem}): "
                                         "the whole model was captured instead")
                cap = None
        if cap is None:
            cap = capture(job.model, job.args, job.kwargs, front_end)
        if isinstance(cap, FxCapture):
            cap.restore_output_type(job.output_type)
        problem = "" if checked else self._capture_mismatch(cap)
        if problem and cap.front_end == "fx" and front_end == "auto":
            cap = DynamoCapture(job.model, f"symbolic_trace graph differs from the model ({problem})")
            problem = self._capture_mismatch(cap)
        if problem:
            raise CaptureError(f"{cap.front_end} capture differs from the model: {problem}")
        if not cap.slots:
            raise CaptureError("Dynamo handed over no graph (torch._dynamo's recompile limit "
                               "reached, or nothing in forward is capturable)")
        if isinstance(cap, DynamoCapture):
            self._require_stable_graphs(cap)
        self.report.front_end, self.report.front_end_reason = cap.front_end, cap.reason
        self.report.left_as_modules = sorted(set(cap.left_as_modules))
        log.info("rewriter: front-end %s (%s), %d graph(s)", cap.front_end, cap.reason, len(cap.slots))
        return cap

    def _regional_capture(self) -> RegionalCapture | None:
        """The regional capture when it is asked for, or chosen ("auto": the model has repeated
        blocks and does not trace whole with symbolic_trace, or says which are its blocks, as
        transformers models do with ``_no_split_modules``); None otherwise."""
        regional, model = self.settings.regional, self.job.model
        if regional is False or self.settings.front_end == "fx":
            return None
        blocks, counted = find_blocks(model), False
        if not blocks and (regional is True or not _traces_whole(model)):
            blocks, counted = find_blocks(model, self._calls_in_one_forward()), True
        if not blocks:
            if regional is True:
                self.report.notes.append("regional=True, but the model has no repeated block: "
                                         "the whole model was captured")
            return None
        names = ", ".join(f"{b.name} x{len(b.instances)}" + (f" ({b.calls} calls)" if b.calls != len(b.instances)
                                                             else "") for b in blocks)
        if regional is True:
            why = f"regional=True: blocks {names}"
        elif counted:
            why = f"blocks {names}, counted in one forward; symbolic_trace does not capture the whole model"
        elif getattr(model, "_no_split_modules", None):
            why = f"blocks {names} (the model's _no_split_modules)"
        elif _traces_whole(model):
            return None  # traces whole: the fx front-end's readable graph
        else:
            why = f"blocks {names}; symbolic_trace does not capture the whole model"
        return RegionalCapture(model, why, blocks, dynamic_lengths=self.job.generation is not None)

    def _calls_in_one_forward(self) -> dict[int, int]:
        """Each submodule's forward calls in one forward on the example inputs (a module run
        twice or more is a block: rewriter.capture.blocks); the model's state as it was after.
        A forward that raises counts nothing: the whole model is captured, as without blocks."""
        try:
            return calls_in_one_forward(self.job.model, lambda: self.job.call(self.job.model))
        except Exception as e:
            log.debug("rewriter: counting the modules' calls raised %s: %s", type(e).__name__, e)
            return {}
        finally:
            self.snapshot.restore()

    def _require_stable_graphs(self, cap: DynamoCapture) -> None:
        """A second call on the same inputs must reuse the graphs. If Dynamo compiles again, its
        guards read Python state that changes per call (a hook counting calls, a step counter
        attribute): past its recompile limit it runs the model eagerly, and every rewrite would
        be kept on paper but never run."""
        before = len(cap.slots)
        grad = torch.enable_grad() if self.job.training else torch.no_grad()  # as Dynamo saw it
        with switched(cap.switch, deterministic=True), grad:
            self.job.call(cap)  # forward only: guards are checked there
        self.snapshot.restore()
        if len(cap.slots) > before:
            raise CaptureError("Dynamo recompiles the model at every call (its guards read Python "
                               "state that changes per call, such as a hook that counts calls or a "
                               "step counter attribute), so a rewrite could not stay in effect")

    def _capture_mismatch(self, cap: Capture) -> str:
        """The captured graphs against the model. Plain fp32 rounding (GEMMs blocked another
        way) is not a mismatch: beyond the bound, a float64 run of the model judges."""
        counting = cap.counting_calls() if isinstance(cap, DynamoCapture) else contextlib.nullcontext()
        try:
            if self.job.generation is not None and not cap.dynamic_lengths:
                # Dynamo hands over a graph static in a length at its first call and a dynamic
                # one at the next length: the warm-up leaves the static ones behind, so the
                # counted run weighs the graphs every later step runs.
                with switched(cap.switch, deterministic=True), torch.no_grad():
                    self.job.generation.warm_up(cap)
            with switched(cap.switch, deterministic=True), counting:
                got = self.job.numerics(cap, deterministic=contextlib.nullcontext())
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            self.snapshot.restore()
        tol = tolerance_for(torch.float32)
        c = compare_runs(got, self.reference.values, tol)
        if not c.ok:
            c = compare_runs(got, self.reference.values, tol, yardstick=self.reference.float64())
        return "" if c.ok else c.problem


def _traces_whole(model: torch.nn.Module) -> bool:
    """Whether torch.fx.symbolic_trace captures ``model`` whole (the fx front-end's graph). The
    trace stores each tensor constant it meets on the module it traces (``_tensor_constant0``,
    ...): those attributes are taken off the model again."""
    before = set(vars(model))
    try:
        torch.fx.symbolic_trace(model)
        return True
    except Exception:
        return False
    finally:
        for name in set(vars(model)) - before:
            delattr(model, name)
