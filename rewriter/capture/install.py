"""Installing a rewritten block forward in every instance of its class, behind the module's call.

The patch is made once per class, where the class's own ``forward`` body runs, so everything the
instance's call wraps around ``forward`` still runs around the rewrite: forward hooks and
pre-hooks, FSDP2's pre/post-forward (all-gather, reshard), DDP, ``torch.utils.checkpoint``
around the block, and transformers' gradient checkpointing (``GradientCheckpointingLayer``
checkpoints the forward it closes over, so that closure's forward is the one replaced).

Only registered instances run the rewrite, and only while their installation is engaged; every
other instance of the class (a copy, another model) runs the class's forward as it was::

    inst = install(Qwen2DecoderLayer, layers, runner)   # runner(module, forward, args, kwargs)
    inst.engaged = True        # registered instances now call runner
    inst.remove()              # the class's forward is exactly what it was

Inside a Dynamo trace both dispatchers are transparent (another model of the class traces as
before), except that a registered instance's whole call runs eagerly (``torch._dynamo.disable``):
a capture of the model around the blocks sees each block as a call, not as code to trace again,
and the block's hooks run as written.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

Runner = Callable[[nn.Module, Callable[..., Any], tuple, dict], Any]


# Set on each registered instance (an attribute, not state: no parameter, buffer or state_dict
# key) so a Dynamo trace of the model around it can tell, and guard, that its call is opaque.
FLAG = "_rewriter_installed"
# Set (by RegionalCapture.lifted) on each registered instance of a repeated block while the
# original model is compiled whole: a trace calls its forward as one nested compile region
# (``_Patch.nested``), compiled once for every instance of the class.
NESTED = "_rewriter_nested"


class _Patch:
    """One class's forward (and call) replaced by dispatchers, and how to put them back.

    Outside a Dynamo trace the forward dispatcher runs the runner for a registered, engaged
    instance and the original forward for any other. Inside a trace (Dynamo tracing another
    model of the class, or the outer graph of this one) both dispatchers are transparent,
    except that a registered instance's whole call is left to run eagerly, as a call.
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        # id(instance) -> (weakref to it, weakref to its installation, that installation's token)
        self.owners: dict[int, tuple[weakref.ref, weakref.ref, object]] = {}
        self.had_own = "forward" in cls.__dict__
        fn = cls.forward
        self.cell = _checkpoint_cell(fn)
        self.original: Callable[..., Any] = self.cell.cell_contents if self.cell else fn
        # one region for the class: Dynamo reuses its compiled graph for every instance (the
        # parameters are the region's inputs), where a whole trace compiles each instance again.
        # It is the forward inside transformers' checkpoint (the cell's): a region around a
        # checkpoint gave wrong gradients under Inductor in torch 2.13, buffer reuse on (LLaMA,
        # 2 layers, bf16 autocast: the gradients' sum 1.35e6 against eager's 339); inside, right.
        self.nested = torch.compiler.nested_compile_region(self.original)
        patch = self

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                owner = patch.owner_of(module)
                if owner is not None and owner.runs_now():
                    return owner.runner(module, patch.original, args, kwargs)
            elif getattr(module, NESTED, False):
                return patch.nested(module, *args, **kwargs)
            return patch.original(module, *args, **kwargs)

        forward.__wrapped__ = self.original  # type: ignore[attr-defined]
        forward.__doc__ = getattr(self.original, "__doc__", None)
        if self.cell is not None:
            self.cell.cell_contents = forward
        else:
            cls.forward = forward

        # A registered instance's whole call, hooks included, is opaque to a Dynamo trace of the
        # model around it: its hooks run as the user wrote them (a hook appending to a list
        # would otherwise be traced, and guarded, into the outer graph at every call), and its
        # forward runs the installed graph.
        self.own_call = cls.__dict__.get("__call__")
        call = cls.__call__
        opaque = torch._dynamo.disable(call)

        def __call__(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() and getattr(module, FLAG, False):
                return opaque(module, *args, **kwargs)
            return call(module, *args, **kwargs)

        __call__.__wrapped__ = call  # type: ignore[attr-defined]
        cls.__call__ = __call__

    def owner_of(self, module: nn.Module) -> "Installation | None":
        entry = self.owners.get(id(module))
        if entry is None or entry[0]() is not module:  # a dead instance's id, reused
            return None
        return entry[1]()

    def remove(self) -> None:
        if self.cell is not None:
            self.cell.cell_contents = self.original
        elif self.had_own:
            self.cls.forward = self.original
        else:
            del self.cls.forward
        if self.own_call is not None:
            self.cls.__call__ = self.own_call
        else:
            del self.cls.__call__


def _checkpoint_cell(fn: Any) -> Any:
    """transformers' ``GradientCheckpointingLayer`` wraps each subclass's forward in
    ``forward_with_checkpointing``, which checkpoints the forward it closes over (``__wrapped__``):
    the closure's cell, so the rewrite runs inside the checkpoint. None for a plain forward."""
    inner = getattr(fn, "__wrapped__", None)
    code = getattr(fn, "__code__", None)  # functools.wraps renames the wrapper, not its code
    if inner is None or not getattr(fn, "__closure__", None) or code is None \
            or "checkpointing" not in code.co_name:
        return None
    for cell in fn.__closure__:
        try:
            if cell.cell_contents is inner:
                return cell
        except ValueError:  # an empty cell
            continue
    return None


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


_PATCHES: dict[type, _Patch] = {}
_LOCK = threading.Lock()


class Installation:
    """Registered instances of one class, the runner they call, and whether it is engaged.

    It holds its instances weakly and is held by whoever installed it (the optimized model's
    capture): when that goes, the instances run their own forward again, and the class is put
    back at the next install or restore (never in the middle of whatever the collection
    interrupted), so an optimized model dropped by its user leaves nothing behind.
    """

    def __init__(self, cls: type, instances: list[nn.Module], runner: Runner) -> None:
        self.cls = cls
        self.runner = runner
        self.engaged = False
        self._local = threading.local()
        _purge()
        with _LOCK:
            patch = _PATCHES.get(cls)
            if patch is None:
                patch = _PATCHES[cls] = _Patch(cls)
            token = object()  # which installation owns an entry (the finalizer cannot hold self)
            for m in instances:
                patch.owners[id(m)] = (weakref.ref(m), weakref.ref(self), token)
                m.__dict__[FLAG] = True
        self._patch = patch
        self._release = weakref.finalize(self, _release, patch, token)

    def instances(self) -> list[nn.Module]:
        """The live instances this installation registered."""
        with _LOCK:
            entries = list(self._patch.owners.values())
        found = []
        for module, owner, _ in entries:
            m = module()
            if m is not None and owner() is self:
                found.append(m)
        return found

    def runs_now(self) -> bool:
        """Whether a registered instance runs the runner in this call. A forward called from
        inside a backward pass is an activation checkpoint's recompute: it runs what the
        forward it recomputes ran (optimize() times the original and the rewritten step one
        after the other, each with its own recompute)."""
        if self.engaged:
            return True
        if _in_backward():
            return getattr(self._local, "forward_ran_runner", False)
        self._local.forward_ran_runner = getattr(self._local, "engaged", False)
        return self._local.forward_ran_runner

    @contextlib.contextmanager
    def engaged_here(self) -> Iterator[None]:
        """Engaged for calls made in this thread during the body (optimize()'s own runs)."""
        old = getattr(self._local, "engaged", False)
        self._local.engaged = True
        try:
            yield
        finally:
            self._local.engaged = old

    def remove(self) -> None:
        """Unregister the instances; the class's forward is put back when none is left."""
        self.engaged = False
        self._release()
        _purge()


def _release(patch: _Patch, token: object) -> None:
    """Unregister the instances ``token``'s installation owns (it is being removed, or was
    collected). The class itself is put back only by :func:`_purge`, at a call of ours: a
    collection can run in the middle of a Dynamo trace, which must not see the class change."""
    with _LOCK:
        for i, (module, _, owned_by) in list(patch.owners.items()):
            if owned_by is token:
                del patch.owners[i]
                if module() is not None:
                    module().__dict__.pop(FLAG, None)
                    module().__dict__.pop(NESTED, None)


def _purge() -> None:
    """Put back every class none of whose registered instances (and installations) is alive."""
    with _LOCK:
        for cls, patch in list(_PATCHES.items()):
            for i, (module, owner, _) in list(patch.owners.items()):
                if module() is None or owner() is None:
                    del patch.owners[i]
            if not patch.owners:
                patch.remove()
                del _PATCHES[cls]


def hooks_of(modules: list[nn.Module]) -> tuple:
    """Which hooks each module has, as comparable handle ids."""
    return tuple((tuple(m._forward_pre_hooks), tuple(m._forward_hooks), tuple(m._backward_hooks),
                  tuple(getattr(m, "_backward_pre_hooks", ()))) for m in modules)


def install(cls: type, instances: list[nn.Module], runner: Runner) -> Installation:
    return Installation(cls, instances, runner)


def installations_on(model: nn.Module) -> list[Installation]:
    """The installations some of ``model``'s modules are registered in."""
    found: dict[int, Installation] = {}
    with _LOCK:
        for m in model.modules():
            patch = _PATCHES.get(type(m)) or next(
                (p for c, p in _PATCHES.items() if isinstance(m, c)), None)
            owner = patch.owner_of(m) if patch is not None else None
            if owner is not None:
                found[id(owner)] = owner
    return list(found.values())


def restore(model: nn.Module) -> int:
    """Take every installed block rewrite off ``model``: its classes' forwards are what they were
    (for the classes no other optimized model still uses). Returns how many installations were
    removed."""
    found = installations_on(model)
    for inst in found:
        inst.remove()
    _purge()
    return len(found)
