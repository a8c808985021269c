"""Deciding on a model already sharded by FSDP2: its parameters gathered once, kept gathered.

A model ``fully_shard``-ed before optimize() gathers each block's parameters in the block's
pre-forward (an all-gather) and reduce-scatters its gradients in the post-backward. Rank 0 cannot
run such a model alone while the other ranks wait for its plan: its first all-gather would pair
with nothing (or with the wrong collective). So every rank, in the same module order, gathers
every FSDP2 module's parameters once (the only collectives, the same on every rank), and while
optimize() runs FSDP2 is told to keep them gathered (no reshard after forward or backward) and
not to reduce gradients: every forward and backward is then local, and rank 0 measures on the
full model while the others wait, then replay its plan on theirs. On the way out the
gradients measuring left in FSDP2's unsharded buffers are dropped, FSDP2's settings are put back
exactly and the parameters resharded: the sharded parameters were never written to::

    with gathered(model):      # on every rank, around optimize()'s pipeline
        ...                    # model.parameters() are the full, unsharded tensors here

The cost: each rank holds the whole model's parameters while optimize() runs (a model that fits
only sharded must be optimized before ``fully_shard``). The user's optimizer holds the sharded
parameters, which no measured step updates, so it is not decided here (:func:`sharded_optimizer_note`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 (``fully_shard``) modules in ``model``, in module order (the same on every rank)."""
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _groups(module: nn.Module) -> list:
    return list(module._get_fsdp_state()._fsdp_param_groups)


# The per-group settings changed while gathered, saved and put back as they were (an int
# post-forward mesh included, which the public setters cannot restore exactly).
_SETTINGS = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads")


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Gather every FSDP2 module's parameters of ``model`` (collectives: call it on every rank)
    and keep every forward and backward local until the block exits. Yields the FSDP2 modules
    (none: a model not sharded by FSDP2, and nothing is done)."""
    modules = fsdp2_modules(model)
    if not modules:
        yield modules
        return
    if any(m._get_fsdp_state()._state_ctx.iter_forward_root is not None for m in modules):
        # the same on every rank, so every rank raises alike: nothing waits on a collective
        raise ValueError(
            "optimize() was called inside a forward of the FSDP2-sharded model (its parameters "
            "are gathered for that forward): call it before or between steps, or optimize() "
            "the model before fully_shard()")
    # A root decides, at its first forward, not to reshard after forward; make that decision
    # now, so the settings saved below are the ones FSDP2 would train with (outermost first: a
    # root claims the modules inside it; blocks sharded without a sharded root are roots too).
    for m in modules:
        if m._get_fsdp_state()._is_root is None:
            m._get_fsdp_state()._lazy_init()
    roots = [m for m in modules if m._get_fsdp_state()._is_root]
    saved = [(g, {k: getattr(g, k) for k in _SETTINGS}) for m in modules for g in _groups(m)]
    try:
        for g, _ in saved:
            g.post_forward_mesh_info = None  # no reshard after forward
            g.reshard_after_backward = False
            g.reduce_grads = False           # gradients stay local: no reduce-scatter
            g.all_reduce_grads = False
        for m in modules:
            m.unshard()  # the all-gathers: the same modules in the same order on every rank
        yield modules
    finally:
        for g, _ in saved:
            for p in g.fsdp_params:  # what measuring left in the unsharded gradient buffers
                p.unsharded_accumulated_grad = None
                if hasattr(p, "_unsharded_param"):
                    p.unsharded_param.grad = None
        for g, settings in saved:
            for k, v in settings.items():
                setattr(g, k, v)
        if all(hasattr(r, "reset_iter_state") for r in roots):
            for r in roots:
                r.reset_iter_state()  # its groups resharded, per-iteration trackers cleared
        else:  # pragma: no cover - torch before reset_iter_state
            for m in modules:
                m.reshard()


def sharded_optimizer_note(optimizer: object) -> str:
    return (f"optimizer: {type(optimizer).__name__} not decided: its parameters are sharded by "
            "FSDP2 and a measured step on the gathered parameters does not update them; "
            "optimize() the model before fully_shard() to decide a fused optimizer")
