"""The model's repeated blocks: the unit regional rewriting decides once and installs everywhere.

A block class is a module class whose instances repeat: two or more of them among the children
of one ``nn.ModuleList`` / ``nn.Sequential``, or a class that a transformers model names in
``_no_split_modules`` (the unit accelerate and FSDP wrap). torch.nn's own classes are not blocks
(a ``Linear`` is an operator, not a block), nor are modules without parameters. A block inside
another block belongs to the outer one::

    for b in find_blocks(model):
        b.cls, [name for name, _ in b.instances]   # Qwen2DecoderLayer, ['model.layers.0', ...]

A block repeats in time too: one instance called several times in a forward (ALBERT's one layer
group, its weights shared by every layer). No structure shows that, so it is counted
(:func:`calls_in_one_forward`, one forward with a counting hook on each module) and handed in::

    find_blocks(model, calls_in_one_forward(model, lambda: model(ids)))   # AlbertLayerGroup, 4 calls
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn


@dataclass
class BlockClass:
    """One block class and its instances in the model, in module order."""

    cls: type
    instances: list[tuple[str, nn.Module]]
    calls: int = 0  # of the block's forward in one forward of the model: 0 is one per instance

    def __post_init__(self) -> None:
        self.calls = self.calls or len(self.instances)

    @property
    def name(self) -> str:
        return self.cls.__name__


def unwrapped_class(module: nn.Module) -> type:
    """The class the user wrote: FSDP2 swaps a sharded instance's class for ``FSDP<Name>``, a
    subclass of ``(FSDPModule, Name)`` made at run time, whose forward is ``Name``'s."""
    cls = type(module)
    index = getattr(cls, "_orig_cls_mro_index", None)
    if isinstance(index, int) and cls.__name__.startswith("FSDP") and len(cls.__mro__) > index:
        return cls.__mro__[index]
    return cls


def _is_torch_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "torch"


def _has_parameters(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def calls_in_one_forward(model: nn.Module, forward: Callable[[], Any]) -> dict[int, int]:
    """How many times each submodule of ``model`` (by ``id``) runs its forward in ``forward()``,
    run once without autograd; the caller restores any state it changes (buffers, RNG)."""
    counts: dict[int, int] = {}

    def count(module: nn.Module, args: Any) -> None:
        counts[id(module)] = counts.get(id(module), 0) + 1
    handles = [m.register_forward_pre_hook(count) for m in model.modules() if m is not model]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return counts


def find_blocks(model: nn.Module, calls: Mapping[int, int] | None = None) -> list[BlockClass]:
    """The repeated block classes of ``model`` (outermost first, in module order). ``calls``
    (:func:`calls_in_one_forward`): a module that runs twice or more in one forward is a block
    too, its ``calls`` the count."""
    calls = calls or {}
    named = {}
    for m in model.modules():
        for n in getattr(m, "_no_split_modules", None) or ():
            named[n] = True
    counts: dict[type, int] = {}
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            for child in m.children():
                cls = unwrapped_class(child)
                counts[cls] = counts.get(cls, 0) + 1
    wanted = {cls for cls, k in counts.items() if k >= 2}
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    inside: list[str] = []  # names of instances already taken: their submodules are not blocks
    for name, m in model.named_modules():
        if m is model or any(name.startswith(p + ".") for p in inside):
            continue
        cls = unwrapped_class(m)
        if (cls in wanted or cls.__name__ in named or calls.get(id(m), 0) >= 2) \
                and not _is_torch_class(cls) and _has_parameters(m):
            by_class.setdefault(cls, []).append((name, m))
            inside.append(name)
    return [BlockClass(cls, inst, sum(max(1, calls.get(id(m), 0)) for _, m in inst))
            for cls, inst in by_class.items()]
