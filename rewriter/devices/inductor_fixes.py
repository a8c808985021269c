"""Inductor miscompiles that crash the process, fixed for rewriter's own compiles.

**The 2D-tiled scatter-add** (pytorch/pytorch#191837, closed upstream with the fix of
#191861, after torch 2.13). Inductor's CPU code generation tiles a loop nest two ways when one
input is read along the outer loop and another along the inner one (``CppTile2DKernel``). For an ``atomic_add``
store with indirect indices (an embedding's or an index's backward: ``index_put(...,
accumulate=True)``), with more than one thread, the tile's inner offset is added to the index
twice: ``CppTile2DKernel.store`` transforms the index, then ``CppVecKernel.store`` derives it
again through ``ops.index_expr``, which this kernel's overrides transform once more. The kernel
scatters to ``x0 + 2*x0_inner + 4*bucket`` instead of ``x0 + x0_inner + 4*bucket``: wrong
gradients and, at the table's end, a write past the buffer. Seen in T5 (torch 2.13, 2-core AMD
EPYC): the regional compile of the first block, whose relative-position bias ([32, 4]) is
an embedding, aborted the process ("double free or corruption", SIGSEGV) in 4 of 13 runs of
``optimize(steps=N)``, during the compile gate's verification: a crash no gate can catch.

While :func:`fixed_codegen` is in force (this thread), that store takes the index once, as
upstream's fix does; Inductor's behaviour elsewhere is its own. The compiles it covers carry a
cache-key tag (``torch.compiler.config.cache_key_tag``), so a kernel cached before the fix,
by an earlier version or without it, is not loaded in place of the fixed one::

    backend = with_inductor_fixes(torch._dynamo.lookup_backend("inductor"))
    compiled = torch.compile(model, backend=backend)

An Inductor whose code generation differs from the one described here (a torch before 2.7 or
after 2.13, a private API that moved) is left as it is (:func:`supported`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

from rewriter.devices.inductor_scope import around_inductor, flag_on

TAG = "rewriter-inductor-fixes-1"  # in the cache key of every compile made with the fixes

_STATE = threading.local()
_INSTALLED: list[bool] = []  # the class patch, made once per process
_INSTALL_LOCK = threading.Lock()

# CppTile2DKernel took atomic_add stores in torch 2.7 (pytorch/pytorch#147961); before, this
# path did not exist. The upstream fix (#191861, 2026-08, the issue closed) is for the releases after 2.13,
# whose code generation this module leaves alone.
_TORCH_RANGE = ((2, 7), (2, 13))


def supported() -> bool:
    """Whether this Inductor's CPU code generation is the one this module fixes."""
    version = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit())
    if not _TORCH_RANGE[0] <= version <= _TORCH_RANGE[1]:
        return False
    try:
        from torch._inductor.codegen.cpp import CppTile2DKernel, CppVecKernel
    except ImportError:
        return False
    return all(callable(getattr(CppTile2DKernel, a, None))
               for a in ("store", "need_vec_transpose", "rename_indexing", "transform_indexing")) \
        and callable(getattr(CppVecKernel, "store", None))


def _parallel_atomic_add(kernel: Any, mode: Any) -> bool:
    """Whether ``CppVecKernel.store`` takes its multi-threaded ``atomic_add`` path, the one that
    builds the index through ``ops.index_expr`` (with one thread it stores the index given)."""
    from torch._inductor import config
    return mode == "atomic_add" and (config.cpp.dynamic_threads or kernel.num_threads != 1)


def _install() -> None:
    """Route ``CppTile2DKernel.store`` through the fix while :func:`fixed_codegen` is in force
    in this thread (Inductor's own store otherwise)."""
    with _INSTALL_LOCK:
        if _INSTALLED:
            return
        from torch._inductor.codegen.cpp import CppTile2DKernel, CppVecKernel
        own_store = CppTile2DKernel.store

        def store(self: Any, name: str, index: Any, value: Any, mode: Any = None) -> Any:
            if getattr(_STATE, "on", False) and _parallel_atomic_add(self, mode) \
                    and not self.need_vec_transpose(self.rename_indexing(index)):
                # CppVecKernel.store transforms the index itself (through this kernel's
                # index_expr), so it is handed the untransformed one
                return CppVecKernel.store(self, name, index, value, mode)
            return own_store(self, name, index, value, mode)

        store.__wrapped__ = own_store  # type: ignore[attr-defined]
        CppTile2DKernel.store = store
        _INSTALLED.append(True)


@contextlib.contextmanager
def fixed_codegen() -> Iterator[None]:
    """Inductor's CPU code generation with the fixes, in this thread, within this block."""
    if not supported():
        yield
        return
    _install()
    config = torch.compiler.config
    tag = config.cache_key_tag
    tagged = contextlib.nullcontext() if TAG in tag.split("+") else \
        config.patch(cache_key_tag=f"{tag}+{TAG}" if tag else TAG)
    with flag_on(_STATE), tagged:
        yield


def with_inductor_fixes(inductor: Callable[..., Any]) -> Callable[..., Any]:
    """``inductor`` (``compile_fx`` or Dynamo's "inductor" backend) with :func:`fixed_codegen`
    in force for the call and for its ``inner_compile``, which AOTAutograd also calls for a
    backward it compiles later, at the first backward."""
    return around_inductor(inductor, fixed_codegen)
