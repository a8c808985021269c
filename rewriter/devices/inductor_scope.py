"""Something in force while Inductor compiles rewriter's graphs, and only then: a thread's flag
that a class patch reads (Inductor's own behaviour whenever it is off), and a backend wrapper
that holds it for the backend call and for Inductor's ``inner_compile``, which AOTAutograd
also calls for a backward it compiles later, at the first backward::

    _STATE = threading.local()

    @contextlib.contextmanager
    def my_scope():
        with flag_on(_STATE):
            yield

    backend = around_inductor(torch._dynamo.lookup_backend("inductor"), my_scope)

Used by rewriter.devices.kernel_batches and rewriter.devices.inductor_fixes.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, Iterator


@contextlib.contextmanager
def flag_on(state: threading.local) -> Iterator[None]:
    """``state.on`` True within this block (this thread), as it was after."""
    before = getattr(state, "on", False)
    state.on = True
    try:
        yield
    finally:
        state.on = before


def around_inductor(inductor: Callable[..., Any], scope: Callable[[], ContextManager[Any]],
                    call_only: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Callable[..., Any]:
    """``inductor`` (``compile_fx`` or Dynamo's "inductor" backend) with ``scope()`` in force for
    the call (a graph AOTAutograd's cache holds is loaded there) and for its ``inner_compile``;
    ``call_only()`` for the call alone."""
    def compile_graph(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner
        inner = kwargs.get("inner_compile") or compile_fx_inner

        def inner_compile(*args: Any, **kw: Any) -> Any:
            with scope():
                return inner(*args, **kw)
        with scope(), call_only():
            return inductor(gm, example_inputs, **{**kwargs, "inner_compile": inner_compile})
    compile_graph.__name__ = getattr(inductor, "__name__", "inductor")
    return compile_graph
