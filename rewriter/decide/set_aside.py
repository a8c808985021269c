"""What a regional compile is handed: block graphs without the kept rewrites the compiler makes
itself, and the graphs outside the blocks that run one of those rewrites left as they run.

The regional compile is the one compile candidate under a regional capture (rewriter.decide.
compile_gate): it is never handed a worse input than the model's own code, so the kept rewrites
the compiler makes itself (``COMPILER_DOES_ITSELF``) are set aside in what it compiles. A graph
outside the blocks (embeddings, mask, head, loss) that runs one of them is not compiled at all:
it runs with the rewrite, as measured. Side by side over the rewritten eager step, training,
steps=20000, 2-core Xeon without AMX (`.diag` runs, one process each), the loss's graph left
eager with fuse_cross_entropy against compiled without it: LLaMA at a 32 000-word vocabulary
1.070x against 0.87x (Inductor's loss maps its [tokens, vocabulary] buffers afresh at every
step); LLaMA at 8000 words 1.127x against 1.099x, first compiled step 17.6 s against 20.0 s;
BERT 0.964x against 0.932x (rejected either way), 15.8 s against 19.0 s::

    source, superseded = compile_sources(run, aside)
    RegionalCompiled(cap, backend, source, superseded)

A loss graph whose logits pass through arithmetic of their own on the way to the loss, after the
kept rewrites (Gemma 2's soft-cap ``c * tanh(z / c)``), is where the compiler fuses what the eager
loss cannot: that graph compiled as well (``heads=True``) is one more candidate the compile gate
measures (:func:`compiled_heads` says where it is offered). Gemma 2, training, steps=20000, 2-core
AMD EPYC, one process (`.diag/loss_compiled.py`): its step 1.092x over the eager loss graph, where
on Gemma and GPT-2 (no such arithmetic) the same read 0.977x and 1.004x.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.capture.regional import EAGER
from rewriter.decide.kept import apply_kept, build


def compile_sources(run: Any, aside: list[str], heads: bool = False) -> tuple[Callable[[Any], Any], list[str]]:
    """(the graph each slot's compile gets, or EAGER; the rewrites in ``aside`` that then run
    nowhere: superseded by the compile). ``heads``: the graphs :func:`compiled_heads` names are
    compiled too."""
    rest = [kp for kp in run.kept if kp.name not in aside]
    outside = _outside(run, aside)
    for name in (_arithmetic_heads(run, rest, list(outside)) if heads else []):
        del outside[name]  # compiled too

    def source(slot: Any) -> Any:
        if slot.name in outside:
            return EAGER
        return slot._run_form(build(slot.original, rest, run.ctx, slot.name))
    still_run = set().union(*outside.values()) if outside else set()
    return source, [name for name in aside if name not in still_run]


def compiled_heads(run: Any, aside: list[str]) -> list[str]:
    """The graphs outside the blocks that run a set-aside rewrite and whose loss reads logits
    with arithmetic of their own after the kept rewrites (:func:`logits_arithmetic`)."""
    rest = [kp for kp in run.kept if kp.name not in aside]
    return _arithmetic_heads(run, rest, list(_outside(run, aside)))


def _arithmetic_heads(run: Any, rest: list, names: list[str]) -> list[str]:
    """Those of the slots ``names`` whose graph, built with the kept rewrites ``rest``, has
    :func:`logits_arithmetic`."""
    slots = {slot.name: slot for slot in run.cap.slots}
    return [name for name in names if logits_arithmetic(build(slots[name].original, rest, run.ctx, name))]


def _outside(run: Any, aside: list[str]) -> dict[str, set[str]]:
    """Each graph outside the blocks that runs one of the set-aside rewrites: its name -> them."""
    held = [kp for kp in run.kept if kp.name in aside]
    outside = {}
    for slot in run.cap.slots:
        if slot.block is None:
            runs = {kp.name for kp in held if apply_kept(slot.original, kp, run.ctx, slot.name) is not None}
            if runs:
                outside[slot.name] = runs
    return outside


# what a loss's logits may go through and still be the head's output as it is: casts, views,
# the shift of a causal LM's labels
_AS_IS_METHODS = frozenset({"float", "to", "type_as", "view", "reshape", "contiguous", "flatten"})
_AS_IS_FUNCTIONS = (operator.getitem, torch.reshape, torch.flatten)
# pointwise arithmetic the compiler fuses into the loss (and its backward) where eager runs a pass each
_ARITHMETIC_FUNCTIONS = (operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div,
                         torch.add, torch.sub, torch.tanh, torch.sigmoid, torch.clamp)
_ARITHMETIC_METHODS = frozenset({"mul", "div", "add", "sub", "tanh", "sigmoid", "clamp"})


def logits_arithmetic(gm: GraphModule) -> bool:
    """Whether a cross-entropy in ``gm`` reads logits that pointwise arithmetic of the graph's own
    made (``c * tanh(z / c)``), through casts and views, rather than the head's GEMM as it is."""
    for node in gm.graph.nodes:
        logits = _ce_logits(gm, node)
        while logits is not None and (
                (logits.op == "call_method" and logits.target in _AS_IS_METHODS)
                or (logits.op == "call_function" and logits.target in _AS_IS_FUNCTIONS)):
            logits = logits.args[0] if isinstance(logits.args[0], Node) else None
        if logits is not None and (
                (logits.op == "call_function" and logits.target in _ARITHMETIC_FUNCTIONS)
                or (logits.op == "call_method" and logits.target in _ARITHMETIC_METHODS)):
            return True
    return False


def _ce_logits(gm: GraphModule, node: Node) -> Node | None:
    """The logits node of an ``F.cross_entropy`` call or an ``nn.CrossEntropyLoss`` call."""
    if node.op == "call_function" and node.target is F.cross_entropy:
        first = node.args[0] if node.args else node.kwargs.get("input")
    elif node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.CrossEntropyLoss):
        first = node.args[0] if node.args else node.kwargs.get("input")
    else:
        return None
    return first if isinstance(first, Node) else None
