"""fuse_cross_entropy: a cross-entropy loss whose gradient is made in the forward pass, in one
buffer, as Liger Kernel's cross-entropy does; the logits stay as they are (returned, read).

Rewrites::

    loss = F.cross_entropy(logits, target, ignore_index=i, reduction="mean" | "sum")
  ->
    loss = fused_cross_entropy(logits, target, i, reduction)

``F.cross_entropy`` keeps the log-probabilities for backward, and its backward writes a zeroed
[tokens, vocab] gradient, scatters into it and runs log-softmax's backward over it: three fresh
tensors the size of the logits (each 32 MB at 1024 tokens x 8000 words in fp32: near glibc's
largest mmap threshold, so whether each lands on warm heap or on freshly mapped pages varies
from step to step) and several passes over memory. The fused form runs per chunk of rows small
enough to stay in cache (CPU; elsewhere one chunk): the log-softmax into the gradient's buffer
(the kernel F.cross_entropy runs), the target's log-probability picked out, then ``exp(logp -
log count)`` in place (an ignored row's shift is +inf, so its row is 0), and the target's
-1/count scattered in. Backward returns that tensor, scaled in place when the incoming gradient
is not 1. On CPU the tensor is one kept between calls while nothing else holds it
(:mod:`rewriter.devices.kept_buffers`): mapped afresh at each call, its pages cost as much as the loss itself.
The cross-entropy of 1024 x 8000 fp32 logits, forward + backward, side by side (``python -m
benchmarks.cross_entropy``, 2-core Xeon without AMX): 1.5-1.9x over two runs, F.cross_entropy
taking 6-20 ms as its tensors land on warm heap or fresh pages, this form 5.5-5.7 ms; at
1024 x 32000 (``--classes 32000``) 4.1-4.2x (110-112 ms against 26-27 ms). In the training step with the expert's SDPA and fused AdamW (one process, 30 pairs, an
earlier unchunked form, an exploratory script): BERT 1.05-1.07x, GPT-2 1.03-1.06x, LLaMA
1.01-1.04x.

An fp32 upcast of the logits' own on the way to the loss (transformers' ``logits.float()``, then
``view(-1, V)``) is dropped, the fused loss upcasting a chunk at a time: in fp32 it did nothing;
under ``optimize(dtype=...)`` (cast_to_half, applied after) the half logits reach the loss as
they are, not through a whole fp32 copy and a whole copy of its gradient back (1024 x 8000 bf16
logits: two copies of ~2.3 ms each in LLaMA's bf16 step on the AMX Xeon). Their gradient is the
fp32 one rounded once to their dtype, as ``.float()``'s backward rounds it; an incoming gradient
other than 1 then scales the rounded values (one more rounding, within that dtype's tolerance).

Safe when: the logits are 2-D fp32 with a 1-D integer target; no class weights, no label
smoothing, no deprecated ``size_average``/``reduce``, reduction ``mean`` or ``sum``, a constant
``ignore_index``. Anything else is declined with the reason. The loss and the gradient equal
the unfused ones up to fp32 rounding (the same log-softmax; the gradient's 1/count folded into
the exponent). An all-ignored batch gives the unfused results: a NaN mean and zero gradients.
Contract: exact. Devices: cpu, cuda, npu (aten ops only; the gate measures each).
Under a regional compile (rewriter.decide.set_aside) a block graph is compiled with the unfused
loss (Inductor fuses the log-softmax and its backward its own way), and a graph outside the
blocks that runs this loss (a causal LM's head) is not compiled: it runs this form, whose
reused buffer Inductor's code does not have.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.capture.ir import (arg, call_arguments, is_op, is_upcast_to_fp32, mark_new_node, single_user,
                                 static_number, tensor_info)
from rewriter.devices.kept_buffers import KeptBuffers, can_keep
from rewriter.pass_api import Pass, PassContext, Site, register_pass


class CrossEntropyGradInForward(torch.autograd.Function):
    """``F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)`` (2-D
    logits), its gradient made in forward (see the module): per chunk of rows, the
    log-probabilities (the kernel F.cross_entropy runs), the target's, then the softmax / count
    in place. Half logits are upcast a chunk at a time and their gradient is rounded to their
    dtype once, as ``.float()``'s backward does; the fp32 copy is never made whole."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                reduction: str) -> torch.Tensor:
        valid = target != ignore_index
        t = torch.where(valid, target, 0)[:, None]  # an ignored row reads class 0, weighs 0
        f32 = dict(dtype=torch.float32, device=logits.device)
        count = valid.sum().to(torch.float32)
        mean = reduction == "mean"
        # softmax / count = exp(log_softmax - log count); an ignored row's shift is +inf: 0
        offset = torch.log(count) if mean else torch.zeros((), **f32)
        shift = torch.where(valid, offset, math.inf)[:, None]
        # the target's -1/count (-1 for a sum) on valid rows; where, not a product: 0/0
        step = torch.where(valid, -1.0 / count if mean else -1.0, 0.0)[:, None]
        wants_grad = ctx.needs_input_grad[0]
        half = logits.dtype != torch.float32
        # fp32 logits: holds the log-probabilities first; half: only the gradient
        grad = gradient_buffer(logits) if wants_grad or not half else None
        picked = torch.empty_like(t, dtype=torch.float32)
        rows = chunk_rows(logits)
        if half:  # one chunk's fp32 upcast and fp32 values, reused chunk after chunk
            upcast, values = (torch.empty((rows, logits.shape[1]), **f32) for _ in range(2))
        for s in range(0, logits.shape[0], rows):  # a chunk stays in cache through its ops
            n = min(rows, logits.shape[0] - s)
            g = values[:n] if half else grad[s:s + rows]
            x = upcast[:n].copy_(logits[s:s + rows]) if half else logits[s:s + rows]
            torch.log_softmax(x, 1, out=g)
            torch.gather(g, 1, t[s:s + rows], out=picked[s:s + rows])
            if wants_grad:
                g.sub_(shift[s:s + rows])
                g.exp_()
                if half:  # the fp32 gradient, then rounded once into the logits' dtype
                    g.scatter_add_(1, t[s:s + rows], step[s:s + rows])
                    grad[s:s + rows].copy_(g)
        per_row = torch.where(valid, -picked[:, 0], 0.0)
        loss = per_row.sum() / count if mean else per_row.sum()
        if wants_grad:
            if not half:
                grad.scatter_add_(1, t, step)
            # saved, so autograd lets it go once the graph is freed (the next step reuses the
            # buffer); backward scales it in place, and a second backward (retain_graph)
            # rescales it by the factor already applied
            ctx.save_for_backward(grad)
            ctx.applied = 1.0
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        (grad,), applied = ctx.saved_tensors, ctx.applied
        scale = _cpu_scalar(grad_loss)
        if scale is None or scale == 0.0 or not math.isfinite(scale):
            # a device scalar (no sync), or a factor that cannot be undone: a new tensor
            return (grad * (grad_loss / applied) if applied != 1.0 else grad * grad_loss), None, None, None
        if scale != applied:  # scaled in place, once per factor: no new [tokens, vocab] tensor
            # .data: the in-place scale is not a change autograd must see (it would refuse the
            # saved tensor at a second backward); the factor applied is tracked here instead
            grad.data.mul_(scale / applied)
            ctx.applied = scale
        return grad, None, None, None


# One per dtype: the buffer is saved for backward, so a step's is free by the next forward.
# 1024 x 32000 fp32 logits, forward + backward, side by side (`.diag` script, 2-core Xeon
# without AMX): 56 ms with a fresh buffer, 28.5 ms reused (32 000 page faults a call, then
# none); at 1024 x 8000 the same 5 ms, but a fresh buffer took 12 ms in one run of two, as
# glibc's heap held it or not.
_SPARES = KeptBuffers(slots=1)


def gradient_buffer(logits: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous tensor the shape of ``logits``: on CPU a kept one
    (``_SPARES``), elsewhere (a caching allocator reuses memory already) or while
    compiling, a new one."""
    if not can_keep(logits.device):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    return _SPARES.take(logits.shape, logits.dtype, logits.device)


def release_buffers() -> None:
    """Free the CPU buffers kept between calls (they are freed once their last user is)."""
    _SPARES.clear()


CHUNK_BYTES = 2 << 20  # CPU: a chunk of logits that stays in cache between its two passes


def chunk_rows(logits: torch.Tensor) -> int:
    """Rows per chunk: on CPU about ``CHUNK_BYTES`` of fp32 logits (2-core Xeon, 1024 x 8000
    fp32, forward + backward, medians of 25 runs of each form in turn, exploratory scripts: an
    earlier form took 5.9-6.4 ms in chunks of 32 to 256 rows and 7.0-10.5 ms in one chunk);
    elsewhere all rows at once (each chunk is a handful of kernel launches there)."""
    if logits.device.type != "cpu":
        return max(1, logits.shape[0])
    per_chunk = CHUNK_BYTES // max(1, logits.shape[1] * 4)  # half logits are worked on in fp32
    return max(1, min(logits.shape[0], per_chunk))


def _cpu_scalar(t: torch.Tensor) -> float | None:
    """``t``'s value where reading it costs no device sync and no trace, else None."""
    if torch.compiler.is_compiling() or type(t) is not torch.Tensor:
        return None
    return float(t.item()) if t.device.type == "cpu" and t.numel() == 1 else None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                        reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)``
    for [tokens, classes] logits (fp32, or half: computed in fp32 a chunk at a time), its
    gradient made in forward::

        loss = fused_cross_entropy(logits.view(-1, vocab), labels.view(-1))
    """
    return CrossEntropyGradInForward.apply(logits, target, ignore_index, reduction)


# Not on cast_to_half's fp32 list (rewriter.devices.amp.FLOAT_OPS), unlike F.cross_entropy: the
# loss is computed in fp32 whatever floating logits it is given, so under optimize(dtype=...)
# half logits come in as they are, not through an fp32 copy of the whole [tokens, vocab] tensor
# (and back for its gradient).


def ce_arguments(gm: GraphModule, node: Node) -> dict[str, Any] | None:
    """The cross-entropy's arguments by name at ``node``: an ``F.cross_entropy`` call (keywords
    or positions: a loss module built inside forward reaches a Dynamo graph positionally) or an
    ``nn.CrossEntropyLoss`` submodule's call (its settings are its attributes); None otherwise."""
    if node.op == "call_function" and node.target is F.cross_entropy:
        return call_arguments(node, F.cross_entropy)
    if node.op == "call_module":
        try:
            mod = gm.get_submodule(str(node.target))
        except AttributeError:
            return None
        if isinstance(mod, nn.CrossEntropyLoss):
            return {"input": arg(node, 0, "input"), "target": arg(node, 1, "target"),
                    "weight": mod.weight, "size_average": None, "reduce": None,
                    "ignore_index": mod.ignore_index, "reduction": mod.reduction,
                    "label_smoothing": mod.label_smoothing}
    return None


def why_not(a: dict[str, Any], dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str | None:
    """Why the cross-entropy with arguments ``a`` (:func:`ce_arguments`) is not rewritten, or
    None when it is (``dtypes``: the logits' dtypes it is written for)."""
    logits, target = tensor_info(a["input"]), tensor_info(a["target"])
    if logits is None or target is None:
        return "the logits' or the target's shape is unknown"
    if logits.ndim != 2 or target.ndim != 1 or target.dtype.is_floating_point:
        return "not [tokens, classes] logits with one class index per token"
    if logits.dtype not in dtypes:
        return f"the logits are {logits.dtype} (the fused loss is written for fp32)"
    if a["weight"] is not None:
        return "a class-weighted loss"
    if a["size_average"] is not None or a["reduce"] is not None:
        return "the deprecated size_average/reduce arguments"
    if a["reduction"] not in ("mean", "sum"):
        return f"reduction={a['reduction']!r}"
    if not isinstance(a["ignore_index"], int):
        return "ignore_index is not a constant"
    if static_number(a["label_smoothing"]) != 0:
        return "label smoothing"
    return None


class FuseCrossEntropy(Pass):
    name = "fuse_cross_entropy"
    contract = "exact"
    version = 2  # 2: the logits' own fp32 upcast dropped, half logits upcast a chunk at a time

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for n in gm.graph.nodes:
            a = ce_arguments(gm, n)
            if a is None:
                continue
            reason = why_not(a)
            if reason is not None:
                ctx.decline(n.name, reason)
            else:
                # the upcast apply() drops, and the flattening it retypes, are the site's too:
                # its region holds them, so the loss is decided on its region, not the step
                sites.append(Site(n, f"{n.name} (cross-entropy, gradient made in forward)", a,
                                  upcast_chain(a["input"])))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            ce, a = site.anchor, site.match
            with g.inserting_before(ce):
                new = g.call_function(fused_cross_entropy, (
                    a["input"], a["target"], a["ignore_index"], a["reduction"]))
            mark_new_node(new, self.name, like=ce)
            ce.replace_all_uses_with(new)
            g.erase_node(ce)
            skip_upcast(g, site.covers)


# the flattening between transformers' ``logits.float()`` and the loss: ``view(-1, V)``
_RESHAPES = ("view", "reshape", "flatten")


def upcast_chain(logits: Node) -> tuple[Node, ...]:
    """The flattening between the loss and the logits' own fp32 upcast, then the upcast, each
    node read by the next only (transformers' ``logits.float().view(-1, V)``); no upcast: ()."""
    chain, node = [], logits
    while is_op(node, *_RESHAPES) and single_user(node):
        chain.append(node)
        node = node.args[0]
    if not (is_upcast_to_fp32(node) and single_user(node)):
        return ()
    return (*chain, node)


def skip_upcast(g: Any, covers: tuple[Node, ...]) -> None:
    """A site's :func:`upcast_chain` (its ``covers``): the flattening reads the upcast's input
    instead and the upcast goes. The fused loss upcasts a chunk at a time, so once cast_to_half
    makes the logits half the whole fp32 copy is not made (nor its gradient's way back); in fp32
    the upcast did nothing."""
    if not covers:
        return
    *chain, node = covers
    source = tensor_info(node.args[0])
    for n in chain:  # the flattening now holds the source's dtype
        info = tensor_info(n)
        if info is not None:
            n.meta["tensor_info"] = dataclasses.replace(info, dtype=source.dtype)
    node.replace_all_uses_with(node.args[0])
    g.erase_node(node)


register_pass(FuseCrossEntropy())
