"""The user's step, as the gate runs it: forward (inference) or forward + backward + optimizer
step (training), on fixed example inputs, plus the numerics run that verification compares.

Without a ``loss_fn``, the training loss is the output's ``loss`` (transformers models given
labels) when it has one, else ``sum(output * c)`` over the outputs that require grad, with a
fixed random cotangent ``c`` (the same for every variant, so gradients compare).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from rewriter.decide.generation import Generation
from rewriter.decide.verify import dropout_off, flatten_output
from rewriter.devices.backends import Backend

VERIFY_SEED = 20260529  # any fixed seed: the reference and the candidate must draw alike
# A float64 copy (8 bytes a parameter) is made for models up to this size (1 GiB of float64).
MAX_FLOAT64_COPY = 2**27
# How a whole step is timed, in the knowledge-base keys of whole-step figures (a pass decided on
# the step, the step check, the graph compiler): version 2 casts the output's cotangent to its
# device and dtype once, where version 1 cast it in every step (on a GPU, or under a precision
# pass, a copy only one of the two steps paid). Figures timed another way are measured again.
STEP_TIMING = "2"


@dataclass
class Job:
    model: nn.Module
    args: tuple
    kwargs: dict
    backend: Backend
    training: bool
    optimizer: torch.optim.Optimizer | None = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    dtype: torch.dtype | None = None
    _cotangents: dict = field(default_factory=dict)
    _cast_cotangents: dict = field(default_factory=dict)
    output_type: type | None = None  # of the model's own output, seen in the reference run
    # Inference of a generating model: the step is a prefill and decode calls (None: one call)
    generation: Generation | None = None

    @property
    def mode(self) -> str:
        return "training" if self.training else "inference"

    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def zero_grads(self) -> None:
        for _, p in self.model.named_parameters():
            p.grad = None

    # --- loss ------------------------------------------------------------------------------
    def loss(self, output: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                 + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            return loss.reshape(())
        builtin = _builtin_loss(output)
        if builtin is not None:
            return builtin
        terms = []
        for path, t in flatten_output(output):
            if t.requires_grad and t.is_floating_point():
                c = self._cotangent(path, t)
                terms.append((t * c).sum())
        if not terms:
            raise ValueError("training mode, but no output of the model requires grad; pass "
                             "loss_fn=, or call model.eval() to optimize for inference")
        return torch.stack(terms).sum()

    def _cotangent(self, path: str, t: torch.Tensor) -> torch.Tensor:
        key = (path, tuple(t.shape))  # not by dtype: a float64 or half run gets the same one
        if key not in self._cotangents:
            gen = torch.Generator().manual_seed(len(self._cotangents))
            self._cotangents[key] = torch.randn(t.shape, generator=gen)
        cast = (key, t.device, t.dtype)  # cast once: not inside every timed step
        if cast not in self._cast_cotangents:
            self._cast_cotangents[cast] = self._cotangents[key].to(t.device, t.dtype)
        return self._cast_cotangents[cast]

    def step_knowledge_key(self) -> dict[str, str]:
        """The device part of a whole-step figure's knowledge-base key, with how steps are timed."""
        return {**self.backend.knowledge_key(), "step timing": STEP_TIMING}

    # --- steps -----------------------------------------------------------------------------
    def call(self, run: Callable[..., Any]) -> Any:
        """The model's part of one step, with ``run`` standing in for the model: one call on
        the example inputs, or, for a generation workload, its prefill and decode calls."""
        if self.generation is not None:
            return self.generation.run(run)
        return run(*self.args, **self.kwargs)

    def step(self, run: Callable[..., Any], optimizer: Any = None) -> Callable[[], None]:
        """One step of the user's job with ``run`` standing in for the model (and ``optimizer``,
        when given, for the job's own)."""
        opt = optimizer if optimizer is not None else self.optimizer
        if not self.training or opt is None:
            return self.forward_backward(run)

        def train() -> None:
            with torch.enable_grad():
                self.loss(self.call(run)).backward()
            opt.step()
            self.zero_grads()
        return train

    def forward_backward(self, run: Callable[..., Any]) -> Callable[[], None]:
        """One step without an optimizer's: the forward (training: its loss's backward, the
        gradients then dropped) with ``run`` standing in for the model."""
        if not self.training:
            def infer() -> None:
                with torch.no_grad():
                    self.call(run)
            return infer

        def train() -> None:
            with torch.enable_grad():
                self.loss(self.call(run)).backward()
            self.zero_grads()
        return train

    def autocast_numerics(self) -> dict[str, torch.Tensor] | None:
        """The numerics of the model under ``torch.autocast(dtype)``, or None where the device
        has no autocast for that dtype."""
        if self.dtype is None or self.dtype not in self.backend.amp_dtypes:
            return None
        try:
            return self.numerics(UnderAutocast(self.model, (self.backend.device_type, self.dtype)))
        except Exception:  # an op without an autocast kernel: no yardstick, the bound alone
            return None

    def float64_numerics(self) -> dict[str, torch.Tensor] | None:
        """The numerics of a float64 copy of the model (the user's model is not touched), or
        None for a model too large to copy or one that does not run in float64."""
        if sum(p.numel() for p in self.model.parameters()) > MAX_FLOAT64_COPY:
            return None
        # The NPU's AI Core has no float64 arithmetic: that copy runs on the host.
        device = "cpu" if self.backend.name == "npu" else None
        try:
            model64 = copy.deepcopy(self.model).to(device=device, dtype=torch.float64)
            args, kwargs = tree_map(lambda x: _to_float64(x, device), (self.args, self.kwargs))
            job64 = dataclasses.replace(self, model=model64, args=args, kwargs=kwargs,
                                        optimizer=None, _cotangents=self._cotangents,
                                        _cast_cotangents={})
            return job64.numerics(model64)
        except Exception:  # user code that insists on fp32 (a loss with fp32 targets, ...)
            return None

    def numerics(self, run: Callable[..., Any], deterministic: Any = None) -> dict[str, torch.Tensor]:
        """Outputs (and, training, parameter gradients) of one seeded run, by name.

        ``deterministic`` is the context that turns dropout off for this run; the default
        (:func:`dropout_off` of the job's model) suits an eager model, a capture passes its own switch.
        """
        self.zero_grads()
        torch.manual_seed(VERIFY_SEED)
        ctx = deterministic if deterministic is not None else dropout_off(self.model)
        grad_mode = torch.enable_grad() if self.training else torch.no_grad()
        with ctx, grad_mode:
            out = self.call(run)
            if run is self.model and self.generation is None:
                self.output_type = type(out)
            result = {f"output {path}": t.detach().clone() for path, t in flatten_output(out)}
            if self.training:
                self.loss(out).backward()
                result.update({f"grad {n}": p.grad.detach().clone()
                               for n, p in self.grad_params() if p.grad is not None})
        self.zero_grads()
        return result


class UnderAutocast:
    """The model's own code, eager, under autocast: the numerics the precision passes are judged
    by (:meth:`Job.autocast_numerics`), what a compiled form of it is timed against when decided
    first (rewriter.decide.compile_first), and the yardstick run of its dropout-on verification
    (rewriter.decide.same_masks)."""

    def __init__(self, model: nn.Module, autocast: tuple[str, torch.dtype]) -> None:
        self.model, self.autocast = model, autocast

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.autocast[0], dtype=self.autocast[1]):
            return self.model(*args, **kwargs)


def model_device(model: nn.Module) -> str:
    """The device type the model's tensors are on ("cpu" for a model without tensors)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device.type
    return "cpu"


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs`` as (args, kwargs): a tuple/list of positional args, a dict of keyword
    args, or one tensor."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise TypeError("example_inputs as a dict must map argument names (str) to values")
        return (), dict(example_inputs)
    raise TypeError("example_inputs must be a tuple of positional args, a dict of keyword args, "
                    f"or a tensor; got {type(example_inputs).__name__}")


def _builtin_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return loss.reshape(())
    return None


@contextlib.contextmanager
def switched(switch: Any, **flags: bool):
    """Set attributes of a capture's Switch for the body, then put them back."""
    old = {k: getattr(switch, k) for k in flags}
    for k, v in flags.items():
        setattr(switch, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(switch, k, v)


def _to_float64(x: Any, device: str | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return x.to(device=device, dtype=torch.float64 if x.is_floating_point() else x.dtype)
