"""The compiled entries our captures leave on code objects, dropped once those captures are gone.

Dynamo keeps a frame's compiled entries on the frame's code object and counts them against
``torch._dynamo.config.recompile_limit`` (8) per code object. Library code is shared by every
model in a process: transformers' ``can_return_tuple`` wraps each model class's forward in one
function, ``wrapper``, and every optimize() compiles it again for its own model (an entry even
where the frame hands over no graph). Past the limit Dynamo runs that frame uncaptured: the
ninth LLaMA optimized in one process lost its outer graphs (5 graphs -> 1), and a model with
dropout then failed its capture check. So every frame Dynamo compiles while a capture runs is
recorded as that capture's (a Dynamo bytecode hook, while :func:`calling` is in effect), and
when a capture starts, the entries of every code object no live capture compiled are dropped
(:func:`release_unowned`: outside any trace). A ``torch.compile`` of the user's that compiled
the same code loses its entries too and compiles again at its next call::

    code_entries.release_unowned()     # a new capture starts
    with code_entries.calling(capture):
        capture.compiled(*args)        # frames compiled here are the capture's
"""
from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Iterator

from torch._C._dynamo.eval_frame import reset_code

# code object -> the captures that compiled a frame of it
_OWNERS: dict[types.CodeType, "weakref.WeakSet[Any]"] = {}
_CALLING: list[Any] = []  # the captures whose calls are in flight, innermost last
_HOOKED: list[Any] = []   # the bytecode hook's handle, once registered


def _compiled(code: types.CodeType, new_code: types.CodeType) -> None:
    """Dynamo's bytecode hook: ``code`` was compiled (it now holds an entry)."""
    if _CALLING:
        _OWNERS.setdefault(code, weakref.WeakSet()).add(_CALLING[-1])


@contextlib.contextmanager
def calling(owner: Any) -> Iterator[None]:
    """Frames Dynamo compiles in the body are ``owner``'s."""
    if not _HOOKED:
        try:
            from torch._dynamo.convert_frame import register_bytecode_hook
        except ImportError:  # pragma: no cover - a torch without the hook: nothing is released
            _HOOKED.append(None)
        else:
            _HOOKED.append(register_bytecode_hook(_compiled))
    _CALLING.append(owner)
    try:
        yield
    finally:
        _CALLING.pop()


def release_unowned() -> int:
    """Drop the compiled entries of the code objects whose captures are all gone; how many."""
    released = 0
    for code, owners in list(_OWNERS.items()):
        if not owners:
            reset_code(code)
            del _OWNERS[code]
            released += 1
    return released
