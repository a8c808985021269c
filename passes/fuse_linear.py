"""fuse_linear: a matmul with a transposed weight, plus a bias, into one ``F.linear``.

A rule table (``rewriter.rules``; ``w`` 2-D (out, in), ``b`` 1-D (out,) or absent)::

    torch.matmul(x, w.t()) + b      ->  F.linear(x, w, b)       (x @ w.T + b, b + x @ w.t())
    torch.addmm(b, x, w.t())        ->  F.linear(x, w, b)       (beta = alpha = 1)
    torch.matmul(x, w.t())          ->  F.linear(x, w)

``w.t()`` is any spelling of the 2-D transpose: ``.t()``, ``.T``, ``.mT``,
``.transpose(0, 1)``, ``.permute(1, 0)`` (``_weight_of_transpose``).
The NPU tuning guide's worked MatMul case: a weight transposed on the fly and fed to matmul
([256,1024] x [1024,256]) costs a non-contiguous copy and a separate bias add; ``F.linear``
takes the weight in its stored layout and fuses the bias into the GEMM epilogue.

Safe when: the transpose is of the last two dims of a 2-D tensor, the bias broadcasts only
along the output features, and the matmul result has no other user (else it must stay).
Contract: exact (one GEMM either way; rounding of the bias add may differ).
Devices: cpu, cuda, npu (F.linear on all three; torch_npu maps it to its MatMul kernel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import Node

from rewriter.capture.ir import arg, op_name, tensor_info
from rewriter.pass_api import register_pass
from rewriter.rules import Match, Rule, RulePass


def linear_bias_pattern(x, wt, b):
    return torch.matmul(x, wt) + b


def addmm_pattern(x, wt, b):
    return torch.addmm(b, x, wt)


def linear_pattern(x, wt):
    return torch.matmul(x, wt)


def _weight_of_transpose(node: object) -> Node | None:
    """``w`` when ``node`` is ``w.t()``, ``w.T`` or ``w.transpose(0, 1)`` of a 2-D ``w``."""
    if not isinstance(node, Node):
        return None
    name = op_name(node)
    src = node.args[0] if node.args else None
    info = tensor_info(src)
    if info is None or info.ndim != 2:
        return None
    if name in ("t", "mT"):
        return src
    if name == "transpose" and {arg(node, 1, "dim0") % 2, arg(node, 2, "dim1") % 2} == {0, 1}:
        return src
    if name == "permute":
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        if tuple(d % 2 for d in dims) == (1, 0):
            return src
    return None


def is_linear(m: Match) -> bool:
    """``x @ w^T`` with a 2-D ``w``, ``x`` of its width and dtype; a bias of its outputs."""
    w = _weight_of_transpose(m["wt"])
    xi, wi = m.info("x"), tensor_info(w)
    if w is None or xi is None or wi is None or xi.ndim < 1 or xi.shape[-1] != wi.shape[1] or xi.dtype != wi.dtype:
        return False
    b = m.info("b") if "b" in m.values else None
    return "b" not in m.values or (b is not None and b.shape == (wi.shape[0],) and b.dtype == wi.dtype)


def _linear(g, m: Match, ctx):
    args = (m["x"], _weight_of_transpose(m["wt"])) + ((m["b"],) if "b" in m.values else ())
    return g.call_function(F.linear, args)


def _describe(m: Match) -> str:
    out, inp = tensor_info(_weight_of_transpose(m["wt"])).shape
    return f"linear {inp}->{out} ({'with bias' if 'b' in m.values else 'no bias'})"


RULES = (  # the bias add first: it claims the matmul before the bare rule can
    Rule("linear", linear_bias_pattern, _linear, (is_linear,), describe=_describe),
    Rule("linear", addmm_pattern, _linear, (is_linear,), describe=_describe),
    Rule("linear", linear_pattern, _linear, (is_linear,), describe=_describe),
)


class FuseLinear(RulePass):
    name = "fuse_linear"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})
    rules = RULES


register_pass(FuseLinear())
