"""A compiled training graph that returns a tensor another of its outputs is computed from (a
language model's logits and the loss made of them) is compiled in two parts, cut after it.

Compiled as one graph (one autograd Function), the returned logits need a gradient of their own
at backward: when the caller differentiates only the loss, autograd makes it a tensor of zeros
the size of the logits, and the compiled backward reads it and adds it in (LLaMA, 4 layers,
vocab 8000, bf16 training on the 2-core Xeon with AMX: a ~3 ms fill of a [4, 256, 8000] tensor
each step, a pass over it, and their fresh pages). Cut after the logits, the loss is a second
graph whose backward hands the first the logits' real gradient; a caller that differentiates the
logits too gets the sum, as eager autograd gives it. The two parts compute what the one graph
computes, op for op; nothing of the model's code changes. The second part is compiled at its
first call, with the tensors the first part returned, handed over as Dynamo hands a graph over
(:mod:`rewriter.devices.dynamo_inputs`: Inductor's and AOTAutograd's caches keep it)::

    backend = cut_after_returned_inputs(inductor)   # a Dynamo backend like inductor
    compiled = torch.compile(model, backend=backend)

What it is worth alone is small (LLaMA 0.99-1.06x over three runs, the others 0.99-1.01x: the
loss's stock backward reads the zeros in its own pass, and the second compile costs ~1.2 s
cold): with rewriter.devices.compiled_loss the two remove the fill and the pass; see that module
for the figures. Declined (the graph compiled whole, as before): no such output; grad mode off;
symbolic sizes (the second part is compiled for the sizes it first sees); a second part that
would read a module or an attribute, draw random numbers or change a tensor in place; a second
part the caller's ``only_if`` refuses.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
from torch.fx import Graph, GraphModule, Node

from rewriter.devices.dynamo_inputs import as_dynamo_hands_it

CompilerBackend = Callable[..., Any]
log = logging.getLogger(__name__)

# random ops: the second part would draw after the first part's draws, in a graph of its own
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
           torch.bernoulli, torch.nn.functional.dropout, torch.dropout, torch.multinomial}


def cut_after_returned_inputs(backend: CompilerBackend,
                              only_if: Callable[[GraphModule], bool] | None = None) -> CompilerBackend:
    """``backend`` (a Dynamo backend) for each graph, except that a training graph returning a
    tensor another output is computed from is compiled in two parts (see the module);
    ``only_if``: a test of the second part, the graph cut only where it holds."""
    def compile_graph(gm: GraphModule, example_inputs: Any) -> Any:
        cut = _cut(gm)
        if cut is None or (only_if is not None and not only_if(cut[1])):
            return backend(gm, example_inputs)
        first, second, plan = cut
        log.debug("rewriter: graph cut after its returned %s", plan["reads"])
        return _TwoParts(backend(first, example_inputs), second, plan, as_dynamo_hands_it(backend))
    compile_graph.__name__ = getattr(backend, "__name__", "compiler")
    return compile_graph


def _value(node: Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _requires_grad(node: Node) -> bool:
    value = _value(node)
    return isinstance(value, torch.Tensor) and value.requires_grad


def _static(node: Node) -> bool:
    """A placeholder of fixed sizes (a symbolic size or a SymInt input: not)."""
    value = _value(node)
    if isinstance(value, torch.Tensor):
        return all(isinstance(s, int) for s in value.shape)
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _outputs(gm: GraphModule) -> tuple[Node, list[Any]]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0]
    return out, list(values) if isinstance(values, (tuple, list)) else [values]


def _downstream(starts: list[Node]) -> set[Node]:
    seen: set[Node] = set()
    todo = [u for s in starts for u in s.users]
    while todo:
        n = todo.pop()
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        todo.extend(n.users)
    return seen


def _safe_in_second(n: Node) -> bool:
    if n.op not in ("call_function", "call_method"):
        return False
    if n.target in _RANDOM or n.target is operator.setitem:
        return False
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return not (name.endswith("_") and not name.startswith("_"))  # in place (add_, copy_, ...)


def _cut(gm: GraphModule) -> tuple[GraphModule, GraphModule, dict] | None:
    """(the first part, the second part, where each output and each read of the second comes
    from) or None when the graph stays whole."""
    if not torch.is_grad_enabled():
        return None
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not all(_static(n) for n in inputs):
        return None
    out, values = _outputs(gm)
    nodes = [v for v in values if isinstance(v, Node)]
    shared = [n for n in nodes if _requires_grad(n)
              and any(o is not n and o in _downstream([n]) for o in nodes)]
    if not shared:
        return None
    second = _downstream(shared)
    if not all(_safe_in_second(n) for n in second):
        return None
    order = [n for n in gm.graph.nodes if n in second]
    # what the second part reads: values the first part computes (it returns them after the
    # graph's own outputs) and the graph's inputs (handed over as the caller gave them)
    reads = list(dict.fromkeys(a for n in order for a in n.all_input_nodes if a not in second))
    in_second = [isinstance(v, Node) and v in second for v in values]
    kept = [v for v, later in zip(values, in_second) if not later]
    # a value the graph returns already is read from that output, not returned twice: each
    # output of an autograd Function gets a gradient of its own, zeros where unused (the cost
    # this cut removes)
    returned = {v: i for i, v in enumerate(kept) if isinstance(v, Node)}
    from_first = [a for a in reads if a.op != "placeholder" and a not in returned]
    where, counts = [], {"first": 0, "second": 0}
    for later in in_second:
        kind = "second" if later else "first"
        where.append((kind, counts[kind]))
        counts[kind] += 1
    plan = {"outputs": where,
            "reads": [("input", inputs.index(a)) if a.op == "placeholder"
                      else ("first", returned[a]) if a in returned
                      else ("first", len(kept) + from_first.index(a)) for a in reads],
            "tuple": isinstance(out.args[0], (tuple, list))}
    first = _first_part(gm, kept, second, from_first)
    later = GraphModule(gm, _second_graph(order, reads, [v for v, x in zip(values, in_second) if x]))
    return first, later, plan


def _first_part(gm: GraphModule, kept: list[Any], second: set[Node], from_first: list[Node]) -> GraphModule:
    graph = Graph()
    env: dict[Node, Node] = {}
    for n in gm.graph.nodes:
        if n.op != "output" and n not in second:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple([env[v] if isinstance(v, Node) else v for v in kept] + [env[a] for a in from_first]))
    return GraphModule(gm, graph)


def _second_graph(order: list[Node], reads: list[Node], outputs: list[Node]) -> Graph:
    """Compiled apart, with the tensors it reads: none of Dynamo's records of its trace (meta)
    comes along."""
    graph = Graph()
    env: dict[Node, Node] = {a: graph.placeholder(f"read_{i}") for i, a in enumerate(reads)}
    for n in order:
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = {}
    graph.output(tuple(env[v] for v in outputs))
    return graph


class _TwoParts:
    """The graph's compiled function, run as its two parts: the graph's inputs in, its outputs
    out as the whole graph returns them."""

    def __init__(self, first: Any, second: GraphModule, plan: dict, backend: CompilerBackend) -> None:
        self.first, self.second_graph, self.plan, self.backend = first, second, plan, backend
        self.second: Any = None

    def __call__(self, *inputs: Any) -> Any:
        got = list(self.first(*inputs))  # as Dynamo calls a backend's function
        p = self.plan
        reads = [inputs[j] if kind == "input" else got[j] for kind, j in p["reads"]]
        if self.second is None:  # compiled at its first call, for these tensors
            self.second = self.backend(self.second_graph, reads)
        more = list(self.second(*reads))
        outs = [more[j] if kind == "second" else got[j] for kind, j in p["outputs"]]
        return outs if p["tuple"] else outs[0]
