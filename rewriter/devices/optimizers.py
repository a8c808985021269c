"""Fused optimizers: the same algorithm, the same param groups and hyper-parameters, fewer kernels.

The tuning guide's second recipe (apex ``NpuFusedSGD``, ``combine_grad=True``). Candidates per
device, tried in order, each gated like a graph rewrite:

* CPU / CUDA: torch's own ``fused=True`` (SGD, Adam, AdamW, Adagrad), then ``foreach=True``.
  Switched **in place** on the user's optimizer (``param_groups[i]['fused']``): the same object,
  so its state stays and a learning-rate scheduler made before ``optimize()`` keeps driving it.
* NPU: ``torch_npu.optim.NpuFused<Name>`` (reference npu_ecosystem.md §2.1) as a new object that
  shares the original's ``param_groups`` list (so schedulers still reach it) and takes over its
  state. Constraints it documents: fp32/fp16 params only, ``zero_grad(set_to_none=True)`` refused,
  products Atlas training, A2 and A3 (not 310P). Taking over state needs one conversion: torch
  keeps ``state['step']`` as a 0-d tensor, and ``torch_npu/optim/npu_fused_adamw.py`` makes the
  group's step counter the first parameter's ``step`` object and increments it once per
  parameter and once as the combined counter: a tensor, incremented in place, would advance
  twice per step and skew the bias correction. The steps are handed over as Python ints, as the
  fused optimizers create them. A group setting the fused constructor does not take (e.g.
  ``maximize=True``) at a value other than torch's default blocks the swap, with the reason.
* apex's ``FusedAdam``/``FusedSGD`` when apex imports (CUDA).

The gate measures the update step alone on scratch copies of the parameters and state (the
user's are untouched), and first checks that 5 steps from the same state and gradients give
the same parameters as the original optimizer.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch

from rewriter.devices.backends import Backend, NpuBackend, import_torch_npu

log = logging.getLogger(__name__)

_TORCH_FUSED = ("SGD", "Adam", "AdamW", "Adagrad")
_TORCH_FOREACH = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
# NpuFused constructors take these hyper-parameters (§2.1); anything else set on a group blocks the swap.
_NPU_FUSED_ARGS = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad"),
    "AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad"),
    "RMSprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"),
    "Adadelta": ("lr", "rho", "eps", "weight_decay"),
}
_APEX_FUSED = {"Adam": ("FusedAdam", {"adam_w_mode": False}), "AdamW": ("FusedAdam", {"adam_w_mode": True}),
               "SGD": ("FusedSGD", {})}


@dataclass
class OptimizerCandidate:
    """One fused form of the user's optimizer: how to build it on any param groups, and how to
    switch the user's own optimizer to it."""

    description: str
    flags: dict[str, Any] | None = None              # in place: group flags to set
    factory: Callable[[list[dict]], torch.optim.Optimizer] | None = None  # replacement object
    # Adapts state taken over from the original (after load_state_dict or a copy).
    adopt_state: Callable[[torch.optim.Optimizer], None] | None = None

    def adopt(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.adopt_state is not None:
            self.adopt_state(optimizer)
        return optimizer

    def build(self, original: torch.optim.Optimizer, param_groups: list[dict]) -> torch.optim.Optimizer:
        """A fused optimizer over ``param_groups`` (scratch copies when measuring)."""
        if self.factory is not None:
            return self.factory(param_groups)
        groups = [{**g, **(self.flags or {})} for g in param_groups]
        return type(original)(groups)

    def switch(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make the user's optimizer fused: in place when possible, else a replacement."""
        if self.flags is not None:
            set_flags(optimizer, self.flags)
            return optimizer
        new = self.factory(optimizer.param_groups)  # type: ignore[misc]
        new.load_state_dict(optimizer.state_dict())
        new.param_groups = optimizer.param_groups  # same list: schedulers keep reaching it
        return self.adopt(new)

    def twin(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The fused form over the same parameters with a copy of the state, leaving
        ``optimizer`` itself as it is (for measuring the real step)."""
        twin = self.build(optimizer, [dict(g) for g in optimizer.param_groups])
        twin.load_state_dict(optimizer.state_dict())  # also loads the old flags back:
        if self.flags is not None:
            set_flags(twin, self.flags)
        return self.adopt(twin)


def set_flags(optimizer: torch.optim.Optimizer, flags: dict[str, Any]) -> None:
    for group in optimizer.param_groups:
        group.update(flags)
    optimizer.defaults.update(flags)
    if flags.get("fused"):
        optimizer._step_supports_amp_scaling = True  # as the constructor does for fused=True
        for p, state in optimizer.state.items():
            # Fused kernels take the step count as a float32 tensor on the parameter's device.
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def candidates(optimizer: torch.optim.Optimizer, backend: Backend) -> tuple[list[OptimizerCandidate], str]:
    """Fused forms of ``optimizer`` on ``backend``, best first, or ([], the reason there is none)."""
    name = type(optimizer).__name__
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return [], f"{type(optimizer).__module__}.{name} is not a torch.optim optimizer; left as it is"
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups):
        return [], f"{name} is already fused"
    if any(g.get("differentiable") for g in groups):
        return [], f"{name}(differentiable=True) has no fused form"
    if backend.name == "npu":
        return _npu_candidates(optimizer, name, backend)
    found = []
    if name in _TORCH_FUSED and _fused_dtypes_ok(optimizer):
        found.append(OptimizerCandidate(f"torch.optim.{name}(fused=True), in place",
                                        flags={"fused": True, "foreach": False}))
    if name in _TORCH_FOREACH and not all(g.get("foreach") for g in groups):
        found.append(OptimizerCandidate(f"torch.optim.{name}(foreach=True), in place",
                                        flags={"foreach": True, "fused": False} if name in _TORCH_FUSED else {"foreach": True}))
    found += _apex_candidates(optimizer, name, backend)
    return found, f"no fused or foreach form of {name} on {backend.name}"


def _fused_dtypes_ok(optimizer: torch.optim.Optimizer) -> bool:
    return all(p.is_floating_point() and not p.is_sparse for g in optimizer.param_groups for p in g["params"])


def _npu_candidates(optimizer: torch.optim.Optimizer, name: str, backend: Backend
                    ) -> tuple[list[OptimizerCandidate], str]:
    """The torch_npu fused form of ``optimizer``, or ([], which condition rules it out)."""
    torch_npu = import_torch_npu()
    allowed = _NPU_FUSED_ARGS.get(name)
    if torch_npu is None:
        return [], "torch_npu does not import here"
    if allowed is None or not hasattr(torch_npu.optim, f"NpuFused{name}"):
        return [], f"torch_npu has no fused {name}"
    why = _fused_optimizer_gate(backend)  # products: Atlas training, A2, A3 (§2.1); the version floor
    if why:
        return [], why
    dtypes = sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]
                     if p.dtype not in (torch.float32, torch.float16)})
    if dtypes:  # NpuFused* raise TypeError for other dtypes (bf16 included), §2.1
        return [], f"torch_npu's NpuFused{name} takes fp32/fp16 parameters only, not {', '.join(dtypes)} (§2.1)"
    dropped = _settings_it_cannot_take(optimizer, allowed)
    if dropped:
        return [], f"torch_npu's NpuFused{name} has no {', '.join(dropped)}: the swap would drop it (§2.1)"
    cls = getattr(torch_npu.optim, f"NpuFused{name}")

    def factory(param_groups: list[dict]) -> torch.optim.Optimizer:
        groups = [{"params": g["params"], **{k: g[k] for k in allowed if k in g}} for g in param_groups]
        return cls(groups)
    return [OptimizerCandidate(f"torch_npu.optim.NpuFused{name} (new object sharing param_groups)",
                               factory=factory, adopt_state=steps_as_ints)], ""


def _fused_optimizer_gate(backend: Backend) -> str | None:
    caps = backend.capabilities() if isinstance(backend, NpuBackend) else None
    return caps.cannot_run("fused_optimizer") if caps is not None else None


# Group keys that change nothing numerically (kernel choice, bookkeeping) or that schedulers add.
_NEUTRAL_SETTINGS = {"params", "foreach", "fused", "capturable", "differentiable", "initial_lr", "name"}


def _settings_it_cannot_take(optimizer: torch.optim.Optimizer, allowed: tuple[str, ...]) -> list[str]:
    """``key=value`` for group settings outside ``allowed`` that differ from the torch
    optimizer's own default (``maximize=True``, ``decoupled_weight_decay=True``, ...)."""
    try:
        defaults = {k: p.default for k, p in inspect.signature(type(optimizer).__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
    except (TypeError, ValueError):
        defaults = {}
    found = []
    for g in optimizer.param_groups:
        for key, value in g.items():
            if key in allowed or key in _NEUTRAL_SETTINGS or key not in defaults:
                continue
            if value != defaults[key] and f"{key}={value!r}" not in found:
                found.append(f"{key}={value!r}")
    return found


def steps_as_ints(optimizer: torch.optim.Optimizer) -> None:
    """Turn tensor ``state['step']`` counters into Python ints (see the module docstring: a
    tensor step would be advanced twice per step by torch_npu's fused optimizers)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            state["step"] = int(step.item())


def _apex_candidates(optimizer: torch.optim.Optimizer, name: str, backend: Backend) -> list[OptimizerCandidate]:
    if backend.name != "cuda" or name not in _APEX_FUSED:
        return []
    try:
        apex_optimizers = importlib.import_module("apex.optimizers")
    except Exception:  # apex is optional and built from source; PyPI's "apex" is unrelated
        return []
    cls_name, extra = _APEX_FUSED[name]
    cls = getattr(apex_optimizers, cls_name, None)
    if cls is None:
        return []
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad") if "Adam" in name else \
        ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def factory(param_groups: list[dict]) -> torch.optim.Optimizer:
        return cls([{"params": g["params"], **{k: g[k] for k in keys if k in g}} for g in param_groups], **extra)
    return [OptimizerCandidate(f"apex.optimizers.{cls_name}", factory=factory)]


# --- scratch copies for measuring -------------------------------------------------------------

def scratch_copy(optimizer: torch.optim.Optimizer, seed: int = 0, only: Collection[int] | None = None,
                 max_numel: int | None = None) -> tuple[list[dict], dict, list[torch.Tensor]]:
    """Param groups over cloned parameters (with fixed random gradients), the state mapped onto
    them, and the clones. The user's parameters and state are not touched. ``only``: the ids of
    the parameters to copy (None: all); a group left with none is dropped. ``max_numel``: a
    larger parameter is copied as its first rows (enough for ``max_numel`` elements; its
    state's tensors of its shape likewise), unless its state holds a tensor of another shape
    (a factored second moment: its rows would not match)."""
    gen = torch.Generator().manual_seed(seed)
    mapping: dict[int, torch.Tensor] = {}
    rows_of: dict[int, int | None] = {}
    groups, clones = [], []
    for g in optimizer.param_groups:
        params = []
        for p in g["params"]:
            if only is not None and id(p) not in only:
                continue
            rows = rows_of[id(p)] = _rows_to_copy(p, optimizer.state.get(p, {}), max_numel)
            c = p.detach()[:rows].clone().requires_grad_(p.requires_grad)
            c.grad = (torch.randn(c.shape, generator=gen, dtype=torch.float32) * 1e-2).to(p.device, p.dtype)
            mapping[id(p)] = c
            params.append(c)
            clones.append(c)
        if not params:
            continue
        groups.append({**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, "params": params})
    state = {mapping[id(p)]: {k: _state_copy(v, p, rows_of[id(p)]) for k, v in st.items()}
             for p, st in optimizer.state.items() if id(p) in mapping}
    return groups, state, clones


def _rows_to_copy(p: torch.Tensor, state: dict, max_numel: int | None) -> int | None:
    """How many leading rows of ``p`` a capped copy takes (None: all of it)."""
    if max_numel is None or p.dim() == 0 or p.numel() <= max_numel:
        return None
    if any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape for v in state.values()):
        return None
    per_row = max(1, p[0].numel())
    return min(p.shape[0], -(-max_numel // per_row))


def _state_copy(v: Any, p: torch.Tensor, rows: int | None) -> Any:
    if not isinstance(v, torch.Tensor):
        return copy.deepcopy(v)
    if rows is not None and v.shape == p.shape:
        return v.detach()[:rows].clone()
    return v.detach().clone()


def scratch_optimizer(optimizer: torch.optim.Optimizer, candidate: OptimizerCandidate | None,
                      seed: int = 0, only: Collection[int] | None = None, max_numel: int | None = None
                      ) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """The user's optimizer (candidate None) or a candidate, over scratch copies (of the
    parameters ``only`` names, or all; capped at ``max_numel`` elements each, see
    :func:`scratch_copy`), same state."""
    groups, state, clones = scratch_copy(optimizer, seed, only, max_numel)
    if candidate is None:
        opt = type(optimizer)(groups)
    else:
        opt = candidate.build(optimizer, groups)
    for p, st in state.items():
        opt.state[p] = st
    if candidate is not None:
        candidate.adopt(opt)
    if candidate is not None and candidate.flags and candidate.flags.get("fused"):
        set_flags(opt, candidate.flags)  # moves the copied step counters where fused wants them
    return opt, clones


# --- the gradient step helpers -----------------------------------------------------------------

def _is_npu_fused(optimizer: Any) -> bool:
    return optimizer is not None and hasattr(optimizer, "clip_grad_norm_fused_")


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, *,
                    optimizer: torch.optim.Optimizer | None = None,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip gradients by their total norm on the device's fastest path.

    With a torch_npu fused optimizer: its ``clip_grad_norm_fused_`` over the combined gradient
    buffer (reference §2.1). Otherwise ``torch.nn.utils.clip_grad_norm_``, whose default picks
    the foreach kernels where the device has them (CUDA; CPU runs the per-tensor loop)::

        loss.backward()
        rewriter.clip_grad_norm_(model.parameters(), 1.0, optimizer=opt)
        opt.step()
    """
    if _is_npu_fused(optimizer):
        return optimizer.clip_grad_norm_fused_(max_norm, norm_type)  # type: ignore[union-attr]
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type,
                                          error_if_nonfinite=error_if_nonfinite)


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """``zero_grad(set_to_none=True)``, except for torch_npu fused optimizers, which keep their
    gradients in combined buffers and refuse ``set_to_none=True`` (reference §2.1)."""
    optimizer.zero_grad(set_to_none=not _is_npu_fused(optimizer))
