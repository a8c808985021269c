"""The model optimize() returns: a drop-in ``nn.Module`` over the user's own model.

It shares the original's parameter, buffer and submodule registries, so ``state_dict()``,
``named_parameters()``, ``.to()`` and checkpoints use the original names and tensors (tied
weights stay tied: they are the same objects). Attributes it does not have (``config``,
``generate``, ...) are read from the original model. Calling it runs the kept rewrites::

    fast = rewriter.optimize(model, example_inputs=(x,))
    fast(x)                      # same outputs within tolerance
    fast.report                  # what was kept and why
    fast.original                # the model as given (same tensors)
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from rewriter.capture.front_ends import DynamoCapture, FxCapture
from rewriter.capture.install import hooks_of as _hooks_of
from rewriter.capture.install import restore as _restore
from rewriter.capture.regional import RegionalCapture
from rewriter.decide.state import preserved_state
from rewriter.devices import amp
from rewriter.devices.executors import CompiledForward, compiled_runner
from rewriter.devices.inductor_fixes import with_inductor_fixes
from rewriter.pipeline import Outcome, replay_on_slot
from rewriter.report import Report

log = logging.getLogger(__name__)

_OWN = ("_model", "_outcome", "_pending", "_fx_by_mode", "report", "_hooks_seen", "_compiled")


def share_registries(shell: nn.Module, model: nn.Module) -> None:
    """Give ``shell`` the registries of ``model``: same names, same tensor objects, so
    ``state_dict()`` keys, optimizers and checkpoints see the model's own tensors."""
    d = shell.__dict__
    d["_parameters"] = model._parameters
    d["_buffers"] = model._buffers
    d["_modules"] = model._modules
    d["_non_persistent_buffers_set"] = model._non_persistent_buffers_set


class OptimizedModel(nn.Module):
    def __init__(self, model: nn.Module, pending: Callable[[tuple, dict], Outcome] | None) -> None:
        super().__init__()
        share_registries(self, model)
        d = self.__dict__
        d["_model"] = model
        d["_pending"] = pending
        d["_outcome"] = None
        d["_fx_by_mode"] = {}
        d["_hooks_seen"] = None  # [modules, their hooks, hook counter] when the rewrites were decided
        # compile(): {"original" or "dynamo": the compiled runner} or {"fx": the backend}
        d["_compiled"] = None
        d["report"] = None
        d["training"] = model.training

    @property
    def original(self) -> nn.Module:
        """The model as the user gave it (sharing its tensors with this one)."""
        return self.__dict__["_model"]

    def restore(self) -> int:
        """Take the installed block forwards off the model (regional rewriting): the block
        classes' forwards are exactly what they were, and from now on the original model runs.
        Same as ``rewriter.restore(fast)``. Returns how many installations were removed."""
        outcome = self.__dict__["_outcome"]
        if outcome is not None and not outcome.use_original:
            outcome.fall_back_to_original("rewriter.restore(): the installed blocks were taken "
                                          "off; the original model runs")
        self.__dict__["_compiled"] = None  # nor a compiled form of it
        removed = _restore(self.__dict__["_model"])
        if outcome is not None and isinstance(outcome.capture, RegionalCapture):
            outcome.capture.remove()  # and Dynamo traces the forwards that call the blocks again
        return removed

    def graph_code(self) -> dict[str, str]:
        """Python code of each captured graph as it now runs (empty before optimizing)."""
        outcome = self.__dict__["_outcome"]
        if outcome is None or outcome.capture is None:
            return {}
        return outcome.capture.graph_code()

    def graph_runs(self) -> list[dict]:
        """Each captured graph (one per signature): its name, the block class it is the forward
        of (None: a graph around the blocks), how often it has run since it was captured
        (optimize()'s own runs included), and whether what runs for it is rewritten. Two
        readings around a workload say which signatures it ran, and whether rewritten::

            before = {g["graph"]: g["runs"] for g in fast.graph_runs()}
            fast.generate(prompt, max_new_tokens=32)
            ran = [g for g in fast.graph_runs() if g["runs"] > before.get(g["graph"], 0)]
        """
        outcome = self.__dict__["_outcome"]
        if outcome is None or outcome.capture is None:
            return []
        live = not outcome.use_original
        return [{"graph": s.name, "block": s.block, "runs": s.runs,
                 "rewritten": live and s.rewritten}
                for s in outcome.capture.slots]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            found = getattr(self.__dict__["_model"], name)
        compiled = self.__dict__["_compiled"]
        runner = compiled.get("original") if compiled else None
        if name == "generate" and isinstance(runner, CompiledForward):
            return _generating_through(runner, found)
        return found

    def train(self, mode: bool = True) -> "OptimizedModel":
        super().train(mode)
        self.__dict__["_model"].training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__["_pending"] is not None:
            self._optimize_now(args, kwargs)
        output = self._runner()(*args, **kwargs)
        outcome = self.__dict__["_outcome"]
        if outcome is not None and outcome.loss_scale is not None and self.training \
                and torch.is_grad_enabled():
            output = amp.scale_outputs(output, outcome.loss_scale)
        return output

    def _optimize_now(self, args: tuple, kwargs: dict) -> None:
        pending = self.__dict__["_pending"]
        outcome = pending(args, kwargs)
        self.__dict__["_pending"] = None
        self._set_outcome(outcome)

    def _set_outcome(self, outcome: Outcome) -> None:
        self.__dict__["_outcome"] = outcome
        self.__dict__["report"] = outcome.report
        modules = _outside_blocks(self.__dict__["_model"], outcome.capture)
        self.__dict__["_hooks_seen"] = [modules, _hooks_of(modules), RemovableHandle.next_id]
        if isinstance(outcome.capture, FxCapture):
            self.__dict__["_fx_by_mode"][outcome.capture.training] = outcome.capture
        if outcome.compiled is not None:  # optimize(compile=...) kept the compiled form
            self.__dict__["_compiled"] = outcome.compiled

    def _runner(self) -> Callable[..., Any]:
        outcome: Outcome = self.__dict__["_outcome"]
        model = self.__dict__["_model"]
        compiled = self.__dict__["_compiled"]
        if outcome is None or outcome.use_original or outcome.capture is None:
            return compiled["original"] if compiled and "original" in compiled else model
        if self._hooks_changed():
            return model
        if isinstance(outcome.capture, DynamoCapture):
            if compiled:
                return compiled["dynamo"]
            if torch.compiler.is_compiling():
                # torch.compile(fast): Dynamo cannot trace into our own torch.compile'd model
                # (an internal assertion); it compiles the original code instead, without the
                # rewrites (fast.compile() keeps them). An fx capture is a plain GraphModule
                # and compiles with them.
                return model
            return outcome.capture  # Dynamo recompiles on a mode change; kept passes replay
        return self._fx_for_mode(model.training)

    def compile(self, backend: str | Callable[..., Any] = "inductor") -> None:  # type: ignore[override]
        """Compile the rewritten graphs with a torch.compile ``backend`` (Inductor by default),
        in place::

            fast = rewriter.optimize(model, example_inputs=(x,))
            fast.compile()           # the kept rewrites, then Inductor's own fusion

        ``torch.compile(fast)`` also works, but for a Dynamo-captured model (transformers v5
        models) it compiles the model's original code and the rewrites are lost. Compiling is
        the user's choice and is not measured; the report notes it. ``optimize(compile=True)``
        measures it instead and keeps it only when the whole step is faster.
        """
        outcome: Outcome | None = self.__dict__["_outcome"]
        if outcome is None:
            raise RuntimeError("compile() needs the optimized model: pass example_inputs to "
                               "optimize(), or call the model once first")
        compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        if backend == "inductor":  # its CPU miscompiles fixed, as optimize(compile=...) compiles
            compiler = with_inductor_fixes(compiler)
        model = self.__dict__["_model"]
        replay = lambda slot: replay_on_slot(slot, outcome.kept, outcome.context)  # noqa: E731
        if outcome.use_original or outcome.capture is None:
            self.__dict__["_compiled"] = {"original": compiled_runner(model, None, compiler, replay)}
        elif isinstance(outcome.capture, DynamoCapture):
            runner = compiled_runner(model, outcome.capture, compiler, replay)
            if hasattr(runner, "keep"):  # regional: the installed blocks run compiled too
                runner.keep()
            self.__dict__["_compiled"] = {"dynamo": runner}
        else:
            self.__dict__["_compiled"] = {"fx": compiler}
            for runner in self.__dict__["_fx_by_mode"].values():
                if isinstance(runner, FxCapture):
                    _compile_fx_capture(runner, compiler)
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", "a backend")
        outcome.report.notes.append(f"compiled with {name} after optimize() (not measured)")

    def _hooks_changed(self) -> bool:
        """Hooks added to submodules after optimize(): a captured graph would silently skip
        them (fx and Dynamo alike), so from then on the original model runs.

        Per call this is one integer compare: every hook registration anywhere advances torch's
        global handle counter, and only then are the modules' hooks compared. (A hook removed
        after optimize() is not looked for, as torch.compile does not look for it either.)
        """
        seen = self.__dict__["_hooks_seen"]
        if RemovableHandle.next_id == seen[2]:
            return False
        modules, hooks = seen[0], seen[1]
        if _hooks_of(modules) == hooks:
            seen[2] = RemovableHandle.next_id  # hooks registered elsewhere
            return False
        outcome: Outcome = self.__dict__["_outcome"]
        reason = ("module hooks changed after optimize(); the rewritten graphs cannot run them, "
                  "so the original model runs (call optimize() again to rewrite with the hooks)")
        if isinstance(outcome.capture, RegionalCapture) and outcome.capture.engaged:
            reason = ("module hooks changed outside the model's blocks after optimize(); the outer "
                      "graphs cannot run them, so the model's own code runs around the blocks, "
                      "whose rewrites still run (call optimize() again to rewrite the rest)")
        outcome.fall_back_to_original(reason)
        warnings.warn(f"rewriter: {reason}", stacklevel=3)
        return True

    def _fx_for_mode(self, training: bool) -> Callable[..., Any]:
        by_mode = self.__dict__["_fx_by_mode"]
        if training in by_mode:
            return by_mode[training]
        # The traced graph baked in train/eval behaviour (dropout, BatchNorm): retrace for this
        # mode on the next call's inputs and replay the kept passes, unmeasured.
        return _LazyFxRetrace(self, training)

    def extra_repr(self) -> str:
        outcome = self.__dict__["_outcome"]
        name = type(self.__dict__["_model"]).__name__
        if outcome is None:
            return f"{name}, not optimized yet (optimizes at the first call)"
        r: Report = outcome.report
        return f"{name}, front_end={r.front_end or 'none'}, kept={r.kept_passes}"

    def __repr__(self) -> str:
        return f"OptimizedModel({self.extra_repr()})"


def _outside_blocks(model: nn.Module, capture: Any) -> list[nn.Module]:
    """The modules whose hooks a captured graph would skip: all of them, except, for a regional
    capture, the blocks and what is inside them (a block's own call, hooks included, runs around
    its installed graph; hooks inside a block are the block runner's to watch)."""
    if not isinstance(capture, RegionalCapture):
        return list(model.modules())
    inside = {id(m) for b in capture.blocks for _, inst in b.instances for m in inst.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def _compile_fx_capture(cap: FxCapture, compiler: Callable[..., Any]) -> None:
    slot = cap.slots[0]
    slot.compiled = torch.compile(slot.kept_run, backend=compiler)


class _LazyFxRetrace:
    def __init__(self, owner: OptimizedModel, training: bool) -> None:
        self.owner, self.training = owner, training

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.owner.__dict__
        model, outcome = d["_model"], d["_outcome"]
        try:
            with preserved_state(model):
                cap = FxCapture(model, args, kwargs, "retraced for a train/eval switch")
            cap.output_type = outcome.capture.output_type
            ctx = dataclasses.replace(outcome.context, training=self.training)
            replay_on_slot(cap.slots[0], outcome.kept, ctx)
            if d["_compiled"]:
                _compile_fx_capture(cap, d["_compiled"]["fx"])
            runner: Callable[..., Any] = cap
        except Exception as e:
            log.warning("rewriter: retrace for %s mode failed (%s); running the original model",
                        "train" if self.training else "eval", e)
            runner = model
        d["_fx_by_mode"][self.training] = runner
        return runner(*args, **kwargs)


def _generating_through(runner: CompiledForward, generate: Callable[..., Any]) -> Callable[..., Any]:
    """The model's ``generate``, calling the compiled forward optimize() kept for it."""
    @functools.wraps(generate)
    def generate_compiled(*args: Any, **kwargs: Any) -> Any:
        with runner.in_place():
            return generate(*args, **kwargs)
    return generate_compiled
