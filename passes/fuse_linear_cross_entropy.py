"""fuse_linear_cross_entropy: a language model's final projection + cross-entropy, chunked over
tokens so the [tokens, vocab] logits are never held whole.

Rewrites what transformers computes when ``labels`` are given (``ForCausalLMLoss`` in
transformers/loss/loss_utils.py, called by LlamaForCausalLM, GPT2LMHeadModel and the rest)::

    logits = F.linear(h, W, b)                  # lm_head (and Gemma-2's cap*tanh(logits/cap))
    loss = F.cross_entropy(logits.float().view(-1, V), shift_labels,
                           ignore_index=-100, reduction="mean" | "sum", label_smoothing=eps)
  ->
    loss = fused_linear_cross_entropy(h.reshape(-1, H), W, b, shift_labels, ...)

The shifted/padded labels stay as the model computes them (in 5.24 the labels are padded with
``ignore_index`` and shifted, the logits are not); a ``/ num_items_in_batch`` after a "sum"
reduction stays too. :class:`LinearCrossEntropy` runs the tokens in chunks whose logits are
about the size of the hidden states: per chunk, the logits (in the model's dtype, then fp32 as
``.float()`` does), their log-sum-exp and the loss; with gradients wanted, the logits' gradient
(softmax - target, smoothed, masked, scaled by the reduction) is made in the same pass and
turned at once into the chunk's ``dh`` and its share of ``dW``/``db`` (accumulated in fp32), as
Liger Kernel does. Backward only scales those by the incoming gradient. The loss and every
gradient equal the unfused ones up to fp32 rounding (bf16: the GEMMs round as the unfused do).
On CUDA with ``liger_kernel`` importable its Triton kernel is used instead (optional, never a
dependency; the gate measures it like any candidate); every other device runs the stock-torch
form (CPU, CUDA, NPU: aten ops only).

The returned logits. transformers returns them beside the loss (the graph's output reads the
lm_head output). Holding them is what this pass exists to avoid, so:

- logits used by anything but the loss and the output (a metric, a second loss): declined.
- logits only returned: with ``optimize(objective="memory")`` in training, the output's
  ``logits`` become None (as Liger's ``LigerForCausalLMLoss`` does); verification then compares
  the loss, the other outputs and every gradient, and the report says the logits were dropped.
  With ``objective="time"`` (the default) or in inference: declined, because a caller may read
  them (inference: the logits are usually the point).

Declined too: logits that reach the loss from another graph (a Dynamo graph break between the
lm_head and the loss, such as a print or a data-dependent branch in a custom loss; transformers'
``logger.warning_once`` there, which GPT2LMHeadModel's ``loss_function`` calls when
``loss_type`` is None, is no break: the capture lets Dynamo drop it, see rewriter.capture.front_ends), a
class-weighted loss, ``reduction="none"``, logits whose flattening is not a plain
``view(-1, V)``/``reshape`` of the linear's output, unknown shapes.
Contract: exact. Devices: cpu, cuda, npu.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.capture.ir import (arg, call_arguments, is_cast, is_op, is_upcast_to_fp32, mark_new_node, static_number,
                                 tensor_info)
from rewriter.pass_api import Pass, PassContext, Site, register_pass

# --- the fused computation ----------------------------------------------------------------------


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: a chunk's logits about the size of the hidden states (Liger's rule),
    but at least 2**23 elements (32 MB fp32): below ~256 tokens a chunk's GEMMs lose much of
    their speed on CPU (measured: 64-token chunks 2x slower than one GEMM, 256-token ~1.2x)."""
    budget = max(tokens * hidden, 1 << 23)
    return max(1, min(tokens, budget // max(vocab, 1)))


class LinearCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy((h @ W.T + b).float(), target, ...)`` in token chunks (see the module).

    Usage::

        loss = LinearCrossEntropy.apply(h2d, W, b, target, -100, "mean", 0.0, None, None, True)
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
                softcap: float | None, chunk: int | None, want_grad: bool = True) -> torch.Tensor:
        n, hidden = h.shape
        vocab = weight.shape[0]
        step = chunk or chunk_tokens(n, hidden, vocab)
        needs = [want_grad and x for x in ctx.needs_input_grad[:3]]
        valid = target != ignore_index
        count = valid.sum()
        # mean over non-ignored tokens: 0/0 = nan when every token is ignored, as torch does
        scale = (1.0 / count.to(torch.float32)) if reduction == "mean" else torch.ones((), device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if needs[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if needs[1] else None
        db = (torch.zeros(vocab, dtype=torch.float32, device=h.device)
              if bias is not None and needs[2] else None)
        eps = float(label_smoothing)
        for start in range(0, n, step):
            hc = h[start:start + step]
            tc = target[start:start + step]
            vc = valid[start:start + step]
            z = F.linear(hc, weight, bias).float()
            if softcap is not None:
                t = torch.tanh(z / softcap)
                z = t * softcap
            safe = torch.where(vc, tc, torch.zeros_like(tc))
            z_t = z.gather(1, safe[:, None]).squeeze(1)
            z_mean = z.mean(dim=-1) if eps else None
            # one exp pass, in place in the chunk's logits: e = exp(z - max), lse = max + log(sum e)
            top = z.amax(dim=-1, keepdim=True)
            e = z.sub_(top).exp_()
            total_e = e.sum(dim=-1)
            lse = top.squeeze(1) + total_e.log()
            nll = lse - z_t
            if eps:
                nll = (1 - eps) * nll + eps * (lse - z_mean)
            total += torch.where(vc, nll, torch.zeros_like(nll)).sum()
            if dh is None and dw is None and db is None:
                continue
            # d loss / d z: softmax - (1-eps) onehot - eps/V, zero where ignored, times the scale
            g = e.div_(total_e[:, None])
            if eps:
                g -= eps / vocab
            g.scatter_add_(1, safe[:, None], torch.full_like(z_t, -(1 - eps))[:, None])
            g *= (vc.to(g.dtype) * scale)[:, None]
            if softcap is not None:
                g *= t.square_().neg_().add_(1)  # d(c*tanh(x/c))/dx = 1 - tanh^2
            g_low = g.to(h.dtype)  # as the unfused backward casts at .float()
            if dh is not None:
                torch.mm(g_low, weight, out=dh[start:start + step])
            if dw is not None:
                if dw.dtype == g_low.dtype:
                    dw.addmm_(g_low.t(), hc)  # no [V, H] temporary per chunk
                else:
                    dw += (g_low.t() @ hc).float()
            if db is not None:
                db += g_low.sum(0, dtype=torch.float32)
        loss = total * scale
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        dh, dw, db = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        go = grad.to(torch.float32)
        one = float(go) == 1.0  # the usual case (loss.backward()): no [V, H] copy

        def scaled(x: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
            if x is None:
                return None
            if one:
                return x if x.dtype == dtype else x.to(dtype)
            return (x * go.to(x.dtype)).to(dtype)
        out_h = scaled(dh, dh.dtype if dh is not None else None)
        out_w = scaled(dw, w_dtype)
        out_b = scaled(db, b_dtype)
        return out_h, out_w, out_b, None, None, None, None, None, None, None


def _liger() -> Any:
    try:  # optional: never a dependency
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception:  # noqa: BLE001 (any import problem: the stock form serves)
        return None
    return LigerFusedLinearCrossEntropyFunction


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               target: torch.Tensor, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               softcap: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """The loss of ``F.cross_entropy(F.linear(h, weight, bias).float().view(-1, V), target, ...)``
    without the full logits. ``h``: [..., H] (flattened to tokens); ``target``: one per token.

    Example::

        loss = fused_linear_cross_entropy(hidden, lm_head.weight, None, shift_labels.view(-1))
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    h2 = h.reshape(-1, h.shape[-1])
    t = target.reshape(-1).to(h.device)
    if t.shape[0] != h2.shape[0]:
        raise ValueError(f"{h2.shape[0]} tokens but {t.shape[0]} targets")
    liger = _liger() if h.is_cuda and chunk is None else None
    if liger is not None:
        try:
            out = liger.apply(h2, weight, t, bias, None, ignore_index, 0.0, label_smoothing,
                              reduction, softcap)
            return out[0] if isinstance(out, tuple) else out
        except TypeError:  # another liger_kernel signature: the stock form
            pass
    return LinearCrossEntropy.apply(h2, weight, bias, t, ignore_index, reduction,
                                    float(label_smoothing), softcap, chunk, torch.is_grad_enabled())


# --- the pass -----------------------------------------------------------------------------------


@dataclass
class LceMatch:
    loss: Node
    linear: Node
    target: Node
    ignore_index: int
    reduction: str
    label_smoothing: float
    softcap: float | None
    chain: list[Node]          # linear .. the node cross_entropy reads, in order
    returned: list[Node]       # chain nodes the graph's output reads (the returned logits)


def _is_ce(node: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and \
        node.target in (F.cross_entropy, torch.nn.functional.cross_entropy)


def _flattens(node: Node, vocab: int) -> bool:
    if not (is_op(node, "view", "reshape") and len(node.args) >= 2):
        return False
    shape = node.args[1:] if len(node.args) > 2 else node.args[1]
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    return len(shape) == 2 and shape[0] == -1 and shape[1] == vocab


def _softcap(node: Node) -> tuple[Node, float] | None:
    """``x * c`` of ``tanh(x / c)``: (x, c)."""
    if not (is_op(node, "mul") and len(node.args) == 2):
        return None
    a, c = node.args
    if not is_op(a, "tanh"):
        a, c = c, a
    cap = static_number(c)
    if not is_op(a, "tanh") or cap is None:
        return None
    inner = a.args[0]
    if not (is_op(inner, "div") and static_number(inner.args[1]) == cap):
        return None
    return inner.args[0], cap


def match(ce: Node) -> LceMatch | str | None:
    """The match at a cross_entropy node, a reason to decline, or None (not this pattern)."""
    source, target = arg(ce, 0, "input"), arg(ce, 1, "target")
    if not isinstance(source, Node):
        return None
    chain: list[Node] = []
    node, vocab = source, None
    info = tensor_info(source)
    if info is None or info.ndim != 2:
        return "the logits' shape is unknown or not [tokens, vocab]"
    vocab = info.shape[1]
    if not _flattens(node, vocab):
        return None
    chain.append(node)
    node = node.args[0]
    if is_cast(node):
        if not is_upcast_to_fp32(node):
            return "the logits are cast to something other than fp32, or moved or laid out anew"
        chain.append(node)
        node = node.args[0]
    softcap = None
    capped = _softcap(node) if isinstance(node, Node) else None
    if capped is not None:
        tanh = node.args[0] if is_op(node.args[0], "tanh") else node.args[1]
        chain += [node, tanh, tanh.args[0]]
        node, softcap = capped
    if isinstance(node, Node) and node.op == "placeholder":
        return ("the logits come from another captured graph (a Dynamo graph break between "
                "lm_head and the loss: TORCH_LOGS=graph_breaks names it)")
    if not is_op(node, "linear"):
        return None
    chain.append(node)
    chain.reverse()
    a = call_arguments(ce, F.cross_entropy)
    if a["weight"] is not None:
        return "a class-weighted loss"
    if a["size_average"] is not None or a["reduce"] is not None:
        return "the deprecated size_average/reduce arguments"
    reduction, ignore, smoothing = a["reduction"], a["ignore_index"], a["label_smoothing"]
    if reduction not in ("mean", "sum"):
        return f"reduction={reduction!r} (a loss per token needs the logits' rows)"
    if not isinstance(ignore, int) or static_number(smoothing) is None:
        return "ignore_index or label_smoothing is not a constant"
    h_info, w_info = tensor_info(node.args[0]), tensor_info(arg(node, 1, "weight"))
    if h_info is None or w_info is None or w_info.ndim != 2 or w_info.shape[0] != vocab:
        return "the projection's shapes are unknown"
    returned: list[Node] = []
    for i, n in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else ce
        others = [u for u in n.users if u is not nxt]
        if any(u.op != "output" for u in others):
            users = ", ".join(u.name for u in others if u.op != "output")
            return f"the logits are used elsewhere ({users}), so they must be computed whole"
        if others:
            returned.append(n)
    return LceMatch(ce, node, target, ignore, reduction, float(static_number(smoothing)),
                    softcap, chain, returned)


class FuseLinearCrossEntropy(Pass):
    name = "fuse_linear_cross_entropy"
    contract = "exact"
    # The saving is the logits held from forward to backward: a property of the whole step.
    scope = "step"
    # Sets the returned logits to None under objective="memory" (see the module).
    drops_outputs = True

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for n in gm.graph.nodes:
            if not _is_ce(n):
                continue
            m = match(n)
            if m is None:
                continue
            if isinstance(m, str):
                ctx.decline(n.name, m)
                continue
            if m.returned and not (ctx.training and getattr(ctx, "objective", "time") == "memory"):
                ctx.decline(n.name, "the logits are returned; this pass drops them (output logits "
                            "None) only with optimize(objective='memory') in training")
                continue
            what = " (output logits become None)" if m.returned else ""
            sites.append(Site(n, f"{m.linear.name} + {n.name}{what}", m))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: LceMatch = site.match
            lin = m.linear
            with g.inserting_before(m.loss):
                new = g.call_function(fused_linear_cross_entropy, (
                    lin.args[0], arg(lin, 1, "weight"), arg(lin, 2, "bias"), m.target,
                    m.ignore_index, m.reduction, m.label_smoothing, m.softcap))
            mark_new_node(new, self.name, like=m.loss)
            m.loss.replace_all_uses_with(new)
            g.erase_node(m.loss)
            for r in m.returned:
                out = next(u for u in r.users if u.op == "output")
                out.args = torch.fx.node.map_arg(out.args, lambda x: None if x is r else x)
            for n in reversed(m.chain):
                if not n.users:
                    g.erase_node(n)


register_pass(FuseLinearCrossEntropy())
