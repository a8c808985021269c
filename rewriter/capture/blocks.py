"""The model's repeated blocks: the unit regional rewriting decides once and installs everywhere.

A block class is a module class whose instances repeat: two or more of them among the children
of one ``nn.ModuleList`` / ``nn.Sequential``, or a class that a transformers model names in
``_no_split_modules`` (the unit accelerate and FSDP wrap). torch.nn's own classes are not blocks
(a ``Linear`` is an operator, not a block), nor are modules without parameters. A block inside
another block belongs to the outer one::

    for b in find_blocks(model):
        b.cls, [name for name, _ in b.instances]   # Qwen2DecoderLayer, ['model.layers.0', ...]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass
class BlockClass:
    """One block class and its instances in the model, in module order."""

    cls: type
    instances: list[tuple[str, nn.Module]]

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


def find_blocks(model: nn.Module) -> list[BlockClass]:
    """The repeated block classes of ``model`` (outermost first, in module order)."""
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
        if (cls in wanted or cls.__name__ in named) and not _is_torch_class(cls) \
                and _has_parameters(m):
            by_class.setdefault(cls, []).append((name, m))
            inside.append(name)
    return [BlockClass(cls, inst) for cls, inst in by_class.items()]
