"""Snapshot and restore of everything measuring could change in the user's job.

Measuring runs real training steps on the user's own parameters (so the timings are of the real
thing), then puts every bit back::

    with preserved_state(model, optimizer, backend):
        ...  # forward, backward, optimizer.step() as often as the gate likes

Restored on exit, also on an exception or KeyboardInterrupt: parameter and buffer values
(BatchNorm running stats included), ``.grad`` tensors, ``requires_grad`` flags, train/eval
flags, optimizer state and hyper-parameters, and the global RNG states (torch CPU and device,
Python ``random``, NumPy). Tensor objects keep their identity; only their contents are copied.
"""
from __future__ import annotations

import contextlib
import copy
import random
from typing import Any, Iterator

import torch
import torch.nn as nn

try:
    import numpy as np
except ImportError:  # numpy is a dependency, but the snapshot need not insist
    np = None  # type: ignore[assignment]


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class StateSnapshot:
    """A copy of a model's (and optimizer's) mutable state; :meth:`restore` writes it back."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 rng_modules: list[tuple[Any, Any]] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        if optimizer is not None:
            for group in optimizer.param_groups:
                tensors.update({id(p): p for p in group["params"]})
        self._tensors = [(t, t.detach().clone()) for t in tensors.values()]
        self._grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone())
                       for p in tensors.values()]
        self._requires_grad = [(t, t.requires_grad) for t in tensors.values()]
        self._training = [(m, m.training) for m in model.modules()]
        self._optimizer_state = None
        if optimizer is not None:
            self._optimizer_state = {p: (dict(st), {k: _clone(v) for k, v in st.items()})
                                     for p, st in optimizer.state.items()}
            self._param_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                                  for g in optimizer.param_groups]
        self._rng = torch.get_rng_state()
        self._device_rng = rng_modules or []
        self._py_rng = random.getstate()
        self._np_rng = np.random.get_state() if np is not None else None

    @torch.no_grad()
    def restore(self) -> None:
        for t, saved in self._tensors:
            t.copy_(saved)
        for p, grad, saved in self._grads:
            if grad is not None:
                grad.copy_(saved)
            p.grad = grad
        for t, flag in self._requires_grad:
            t.requires_grad_(flag)
        for m, flag in self._training:
            m.training = flag
        if self.optimizer is not None:
            self._restore_optimizer()
        torch.set_rng_state(self._rng)
        for module, state in self._device_rng:
            module.set_rng_state_all(state)
        random.setstate(self._py_rng)
        if np is not None:
            np.random.set_state(self._np_rng)

    def _restore_optimizer(self) -> None:
        opt = self.optimizer
        assert opt is not None and self._optimizer_state is not None
        for p in list(opt.state.keys()):
            if p not in self._optimizer_state:
                del opt.state[p]  # state the measured steps created
        for p, (original, saved) in self._optimizer_state.items():
            state = opt.state[p]
            state.clear()
            for k, v in original.items():
                if isinstance(v, torch.Tensor):
                    v.copy_(saved[k])  # the user's own state tensor object, old contents
                    state[k] = v
                else:
                    state[k] = copy.deepcopy(saved[k])
        for group, saved in zip(opt.param_groups, self._param_groups):
            group.update(copy.deepcopy(saved))


@contextlib.contextmanager
def preserved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    rng_modules: list[tuple[Any, Any]] | None = None) -> Iterator[StateSnapshot]:
    """Run the body, then restore the model's and optimizer's state, whatever happened."""
    snapshot = StateSnapshot(model, optimizer, rng_modules)
    try:
        yield snapshot
    finally:
        snapshot.restore()
