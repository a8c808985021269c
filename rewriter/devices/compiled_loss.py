"""The cross-entropy a compiler is handed: one whose backward it writes in one pass.

Inductor (torch 2.13, CPU) compiles ``F.cross_entropy``'s backward from its decomposition:
nll_loss's backward is a dense compare of every class against the target (int64 vectors), then
log-softmax's backward, then the returned logits' zero gradient added in (1024 x 8000 bf16
logits: several passes, ~7 ms of LLaMA's ~80 ms compiled bf16 step on the 2-core Xeon with
AMX, where writing the gradient once costs ~2.5 ms). This form states the gradient directly:
``softmax(x) * scale`` written once in the logits' dtype, then each row's target entry set
(an N-element scatter), the log-sum-exp and the target's logit kept from forward::

    backend = with_compiled_losses(inductor)   # a Dynamo backend like inductor
    compiled = torch.compile(model, backend=backend)

``with_compiled_losses`` rewrites each Dynamo graph before the compiler gets it:
``F.cross_entropy(logits.float().view(-1, V), target, ignore_index=i, reduction=r)`` (an
``nn.CrossEntropyLoss`` alike) -> ``compiled_cross_entropy(logits.view(-1, V), target, i, r)``,
under the conditions of the eager fused loss (``passes.fuse_cross_entropy.why_not``: 2-D fp32
logits, a 1-D int64 target, no class weights or label smoothing, ``mean`` or ``sum``, a
constant ``ignore_index``); its own fp32 upcast of half logits is dropped, as that pass drops
it (the form upcasts inside; its gradient is the fp32 one rounded once to the logits' dtype, as
``.float()``'s backward rounds it). Anything else is left as it is.

Measured with :func:`rewriter.devices.loss_cut.cut_after_returned_inputs` (the loss's graph cut
from the model's, so the returned logits get no zero gradient; alone, this form's separate
scatter makes that zero gradient's add a pass of its own): the compiled bf16 training step
(nested blocks, autocast, fused AdamW), 4 layers, hidden 256, vocab 8000, 4 x 256 tokens, 2-core
Xeon with AMX, torch 2.13, interleaved in one process (``.diag/cut_ce.py``), over the stock
compile: LLaMA 1.135x, Qwen2 1.149x, GPT-2 1.030x, BERT 1.064x, DistilBERT 1.074x (the
process's default allocator); with freed host memory kept (no fresh pages at all: the work
alone) 1.068x, 1.059x, 1.034x, 1.040x, 1.033x. Loss and gradients equal the stock form's up to
fp32 rounding. AOTAutograd's cache keeps a graph holding the form (``CACHEABLE``, keyed by
``VERSION``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import GraphModule

CompilerBackend = Callable[..., Any]

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

    done = 0
    for node in list(gm.graph.nodes):
        a = ce_arguments(gm, node)
        if a is None or why_not(a) is not None:
            continue
        target = tensor_info(a["target"])
        if target is None or target.dtype != torch.int64:  # gather's index (why_not allows any int)
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


def with_compiled_losses(backend: CompilerBackend) -> CompilerBackend:
    """``backend`` (a Dynamo backend), each graph's cross-entropies rewritten first
    (:func:`rewrite_losses`)."""
    def compile_graph(gm: GraphModule, example_inputs: Any) -> Any:
        rewrite_losses(gm)
        return backend(gm, example_inputs)
    compile_graph.__name__ = getattr(backend, "__name__", "compiler")
    return compile_graph
