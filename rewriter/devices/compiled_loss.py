"""The cross-entropy a compiler is handed: in a form that costs one pass at backward.

Inductor (torch 2.13, CPU) compiles ``F.cross_entropy``'s backward from its decomposition:
nll_loss's backward is a dense compare of every class against the target (int64 vectors), then
log-softmax's backward, then the returned logits' zero gradient added in (a model returning its
logits beside the loss, compiled as one graph: autograd makes that gradient a tensor of zeros).
1024 x 8000 bf16 logits: several passes, ~7 ms of LLaMA's ~80 ms compiled bf16 step on the
2-core Xeon with AMX, where writing the gradient once costs ~2.5 ms. :func:`with_compiled_losses`
changes the graphs a compiler is handed, and nothing else::

    backend = with_compiled_losses(inductor)   # a Dynamo backend like inductor
    compiled = torch.compile(model, backend=backend)

1. Each qualifying cross-entropy -> :func:`compiled_cross_entropy`, whose backward writes
   ``softmax(x) * scale`` once in the logits' dtype and sets each row's target entry (an
   N-element scatter), the log-sum-exp and the target's logit kept from forward. Qualifying: the
   conditions of the eager fused loss (``passes.fuse_cross_entropy.why_not``: 2-D logits, a 1-D
   int64 target, no class weights or label smoothing, ``mean`` or ``sum``, a constant
   ``ignore_index``), the logits fp32 or, under CPU autocast, of autocast's dtype (autocast runs
   F.cross_entropy in fp32: the same math); an fp32 upcast of half logits on the way is dropped
   (the form upcasts inside; its gradient is the fp32 one rounded once, as ``.float()``'s
   backward rounds it).
2. A graph returning the logits its loss is made of is cut after them
   (:mod:`rewriter.devices.loss_cut`): the returned logits get no zero gradient, and the loss is
   a second compiled graph (one more compile: ~1.2 s cold, ~0.3 s from a warm cache). A cut
   whose second part holds no loss is not made. (Running that part uncompiled, the eager fused
   loss in it, saves the compile but read ~3 % slower steps in the benchmark's processes: LLaMA
   2.80 / 2.81x against 2.88 / 2.86x, Qwen2 2.61 / 2.74x against 2.79 / 2.75x, alternating.)

The compiled bf16 training step (the original model, nested blocks, autocast, fused AdamW), 4
layers, hidden 256, vocab 8000, 4 x 256 tokens, 2-core Xeon with AMX, torch 2.13, interleaved in
one process (``.diag/cut_ce.py``), over the stock compile: LLaMA 1.10-1.17x (three runs),
Qwen2 1.149x, BERT 1.084x, DistilBERT 1.074x (the cut alone, before half logits qualified);
GPT-2, whose loss is a graph of its own already (transformers breaks the graph there),
1.03-1.04x from (1) alone. Loss and gradients equal the stock form's up to
fp32 rounding. AOTAutograd's cache keeps a graph holding the form (``CACHEABLE``, keyed by
``VERSION``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from rewriter.devices.loss_cut import cut_after_returned_inputs

CompilerBackend = Callable[..., Any]
log = logging.getLogger(__name__)

VERSION = "1"  # in AOTAutograd's cache key: a change to the form's code must change it


class CompiledCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)`` for [N, C]
    logits, written for a compiler: forward keeps the log-sum-exp and the target's logit,
    backward writes ``softmax * scale`` once in the logits' dtype and sets each row's target
    entry (an all-ignored ``mean`` batch: a NaN loss and zero gradients, as F.cross_entropy)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                reduction: str) -> torch.Tensor:
        x = logits.float()
        lse = torch.logsumexp(x, 1)
        valid = target != ignore_index
        t = torch.where(valid, target, 0)  # an ignored row reads class 0 and weighs 0
        picked = x.gather(1, t[:, None])[:, 0]
        total = torch.where(valid, lse - picked, 0.0).sum()
        count = valid.sum() if reduction == "mean" else None
        ctx.save_for_backward(logits, t, valid, lse, picked, *(() if count is None else (count,)))
        return total / count if count is not None else total

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        logits, t, valid, lse, picked, *count = ctx.saved_tensors
        per_row = grad_loss / count[0] if count else grad_loss
        scale = torch.where(valid, per_row, 0.0)  # [N]
        grad = (torch.exp(logits.float() - lse[:, None]) * scale[:, None]).to(logits.dtype)
        rows = torch.arange(logits.shape[0], device=logits.device)
        at_target = ((torch.exp(picked - lse) - 1.0) * scale).to(logits.dtype)
        return grad.index_put((rows, t), at_target), None, None, None


def compiled_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                           reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)``
    for [N, C] logits and an int64 [N] target, its backward one pass (see the module)."""
    return CompiledCrossEntropy.apply(logits, target, ignore_index, reduction)


# AOTAutograd caches a graph only if it knows every function in it: this one, by name and version
CACHEABLE = {f"{compiled_cross_entropy.__module__}.{compiled_cross_entropy.__name__}": VERSION}


def rewrite_losses(gm: GraphModule) -> int:
    """Each cross-entropy of ``gm`` (a Dynamo graph) that qualifies (see the module) made
    :func:`compiled_cross_entropy`, in place; how many."""
    from passes.fuse_cross_entropy import ce_arguments, skip_upcast, upcast_chain, why_not
    from rewriter.capture.ir import tensor_info

    # under CPU autocast, F.cross_entropy of half logits computes in fp32 (autocast's fp32 list):
    # what this form computes
    half = (torch.get_autocast_dtype("cpu"),) if torch.is_autocast_enabled("cpu") else ()
    done = 0
    for node in list(gm.graph.nodes):
        a = ce_arguments(gm, node)
        if a is None or why_not(a, (torch.float32, *half)) is not None:
            continue  # (why_not passed: both infos are known)
        logits, target = tensor_info(a["input"]), tensor_info(a["target"])
        if logits.dtype != torch.float32 and logits.device.type != "cpu":  # CPU autocast's only
            continue
        if target.dtype != torch.int64:  # gather's index (why_not allows any integer)
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(compiled_cross_entropy, (
                a["input"], a["target"], a["ignore_index"], a["reduction"]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        skip_upcast(gm.graph, upcast_chain(a["input"]))
        done += 1
    if done:
        gm.recompile()
    return done


def _holds_a_loss(part: GraphModule) -> bool:
    # a cut anywhere else (GPT-2: its head, after the hidden states) measured no gain or a loss
    return any(n.target is compiled_cross_entropy for n in part.graph.nodes)


def with_compiled_losses(backend: CompilerBackend) -> CompilerBackend:
    """``backend`` (a Dynamo backend), each graph's cross-entropies rewritten first
    (:func:`rewrite_losses`), then a graph that returns the logits its loss is made of cut after
    them (rewriter.devices.loss_cut) where the part after the cut holds a loss."""
    cut = cut_after_returned_inputs(backend, only_if=_holds_a_loss)

    def compile_graph(gm: GraphModule, example_inputs: Any) -> Any:
        log.debug("rewriter: %d cross-entropies in their compiled form", rewrite_losses(gm))
        return cut(gm, example_inputs)
    compile_graph.__name__ = getattr(backend, "__name__", "compiler")
    return compile_graph
