"""A graph handed to a compiler outside Dynamo, the way Dynamo hands it over, so it can be cached.

The regional compile calls the backend itself, ``backend(gm, example_inputs)``, with no Dynamo
frame around the graph (no guards to check at each of its many calls). Called so, with real
tensors and no tracing context, AOTAutograd makes a fake mode without a ShapeEnv, and both
Inductor's FX-graph cache and AOTAutograd's cache refuse the graph ("No shape env"): a second
process paid the whole Python side of the compile again and got only the C++ kernels from the
cache (BERT, 4 layers, training, 2-core Xeon: a warm compile of 6.0 s; with this, 2.5 s, every
graph a hit in both caches). Dynamo hands a backend fake tensors from a fake mode with a
ShapeEnv, inside a TracingContext; :func:`as_dynamo_hands_it` does the same, with static shapes
(the graph is specialized to the example's sizes, as it was)::

    compile_graph = as_dynamo_hands_it(torch._dynamo.lookup_backend("inductor"))
    compiled = compile_graph(gm, [x, mask])   # called with real tensors afterwards
    out = compiled(x, mask)

The caches key what decides the compiled code (the graph, its tensor constants by value, the
inputs' sizes, dtypes and strides, the settings); parameters and buffers are inputs of the
compiled graph (AOTAutograd lifts them), read at each call, so their values are not in the key.
Inside a trace already (a tracing context, or fake example inputs) the backend gets the inputs
as they come.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

CompilerBackend = Callable[..., Any]


def as_dynamo_hands_it(backend: CompilerBackend) -> CompilerBackend:
    """``backend``, given static fake inputs of a fake mode with a ShapeEnv, in a tracing context."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    @functools.wraps(backend)
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if TracingContext.try_get() is not None or any(isinstance(t, FakeTensor) for t in example_inputs):
            return backend(gm, example_inputs)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [fake_mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
                 for t in example_inputs]
        with tracing(TracingContext(fake_mode)):
            return backend(gm, fakes)
    return compile_graph
