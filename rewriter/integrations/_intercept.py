"""Route a trainer's own call of one model method through ``optimize()``'s result.

Trainers hold on to the model object they were given (and wrap it: DDP, accelerate), so the
rewritten graphs cannot be handed over as a new object. Instead the method the trainer calls
(``forward`` for Hugging Face ``Trainer``, ``training_step`` for Lightning) is shadowed by an
instance attribute, as accelerate itself does for mixed precision::

    step = MethodInterceptor(model, "forward", decide)   # decide(shell, args, kwargs) -> fast
    step.install()       # model.forward(...) now dispatches; the first training call decides
    ...
    step.uninstall()     # model.forward is the class's again

``decide`` gets a :class:`ModuleShell`: an ``nn.Module`` that shares the model's parameter,
buffer and submodule registries (so parameter names, tied weights and the optimizer's tensors
are the model's own) and whose ``forward`` is the method as it was before interception. That is
what ``optimize()`` captures, measures and rewrites; the shell's forward never reaches the
dispatcher, so nothing recurses.

Only calls in training mode with gradients enabled run the rewritten graphs (that is the step
that was measured and verified); evaluation and generation run the model as it is.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Any, Callable

import torch
import torch.nn as nn

from rewriter.wrapper import OptimizedModel, share_registries

log = logging.getLogger(__name__)

# Options a trainer integration sets itself; the rest of optimize()'s keywords pass through.
_SET_BY_INTEGRATION = ("model", "example_inputs", "optimizer")


def check_options(options: dict[str, Any]) -> None:
    """Refuse keywords ``optimize()`` does not take, before any training starts."""
    from rewriter.api import optimize
    known = [n for n in inspect.signature(optimize).parameters if n not in _SET_BY_INTEGRATION]
    for name in options:
        if name in _SET_BY_INTEGRATION:
            raise TypeError(f"{name!r} is taken from the trainer and cannot be given")
        if name not in known:
            raise TypeError(f"unknown optimize() option {name!r}; known: {', '.join(known)}")


class ModuleShell(nn.Module):
    """The model's registries with ``forward`` = one method of the model, as it was."""

    def __init__(self, model: nn.Module, call: Callable[..., Any], name: str) -> None:
        super().__init__()
        share_registries(self, model)
        d = self.__dict__
        d["_shell_of"] = model
        d["_call"] = call
        d["training"] = model.training
        d["_shell_name"] = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.fx._symbolic_trace.is_fx_tracing():
            # A trainer's step takes the trainer's batch as it comes: Dynamo captures it.
            raise TypeError("a trainer's step is captured by Dynamo, not symbolic_trace")
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_shell_of")
            if model is None:  # half-built (copy.deepcopy reconstructs before __setstate__)
                raise
            return getattr(model, name)

    def extra_repr(self) -> str:
        return self.__dict__["_shell_name"]


Decide = Callable[[ModuleShell, tuple, dict], "OptimizedModel | None"]


class MethodInterceptor:
    """Shadows ``model.<method>``; the first training call decides, later ones run rewritten."""

    def __init__(self, model: nn.Module, method: str, decide: Decide) -> None:
        self.model, self.method = model, method
        self._decide = decide
        self.fast: OptimizedModel | None = None
        self.decided = False
        self.rewritten_calls = 0  # training calls that ran the rewritten graphs
        self._installed = False
        self._had_own = False
        self._previous: Any = None
        self.shell: ModuleShell | None = None

    def install(self) -> None:
        if self._installed:
            return
        d = self.model.__dict__
        self._had_own, self._previous = self.method in d, d.get(self.method)
        original = getattr(self.model, self.method)  # the bound method, or an instance attribute
        if self.shell is None:
            # The class's method, or what was already installed (accelerate's autocast forward)
            call = self._previous if self._had_own else types.MethodType(
                getattr(type(self.model), self.method), self.model)
            # Named after the model's class: the report and the progress lines say "GPT2LMHeadModel"
            shell_type = type(type(self.model).__name__, (ModuleShell,), {"__module__": __name__})
            self.shell = shell_type(self.model, call, f"{type(self.model).__name__}.{self.method}")

        @functools.wraps(original)  # the trainer inspects the signature (Lightning's batch_idx)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return self._dispatch(args, kwargs)

        d[self.method] = dispatch
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        d = self.model.__dict__
        if self._had_own:
            d[self.method] = self._previous
        else:
            d.pop(self.method, None)
        self._installed = False

    def _dispatch(self, args: tuple, kwargs: dict) -> Any:
        assert self.shell is not None
        training = self.model.training and torch.is_grad_enabled()
        if not training:
            return self.shell.forward(*args, **kwargs)
        if not self.decided:
            self.decided = True
            self.shell.__dict__["training"] = True
            self.fast = self._decide(self.shell, args, kwargs)
        if self.fast is None:
            return self.shell.forward(*args, **kwargs)
        if not self.fast.training:
            self.fast.train(True)  # the trainer switched modes on the model, not on the shell
        self.rewritten_calls += 1
        return self.fast(*args, **kwargs)


def example_inputs_of(args: tuple, kwargs: dict) -> tuple | dict:
    """The call's inputs in the form ``optimize()`` takes: positional or keyword, not both."""
    if args and kwargs:
        raise ValueError("the step was called with both positional and keyword arguments "
                         f"({len(args)} positional, keywords {sorted(kwargs)}); optimize() takes "
                         "one or the other")
    return kwargs if kwargs else args


def summary(report: Any) -> str:
    """One line for a trainer's log: what was kept, and the whole step's verdict."""
    kept = ", ".join(report.kept_passes) or "nothing"
    verdict = (report.final or {}).get("reason", "")
    return f"rewriter kept {kept} ({report.front_end or 'no capture'}; {verdict})"
