"""make_contiguous: one ``.contiguous()`` right after a non-contiguous view that operators copy.

Rewrites (``v`` a transpose / permute / expand / slice whose strides are not row-major)::

    v = x.transpose(1, 2)                 v = x.transpose(1, 2)
    a = torch.matmul(v, w1)         ->    v_c = v.contiguous()
    b = torch.matmul(v, w2)               a = torch.matmul(v_c, w1)
    c = v * 2                             b = torch.matmul(v_c, w2)
                                          c = v * 2               # element-wise: reads strides

GEMMs, convolutions, ``reshape`` and norms need contiguous memory: given a strided view, each
makes its own copy (on the NPU a ``contiguous_d_*`` kernel, AsStrided in the generic case; tuning
guide 调优手段3, reference npu_ecosystem.md §9 pitfall 10). With one copy right after the view,
its readers share it. With a single GEMM, conv or reshape reader the copy only moves to the
producer, which the reference's cheat-sheet (§10) lists as worth trying where a profile shows
``contiguous_d_AsStrided``; whether it helps is the gate's to measure. Only readers that need
contiguous memory are rerouted; element-wise readers keep the view.
Fires when a non-contiguous view has two or more such readers, or feeds a matmul, bmm, linear,
conv or reshape. On CPU, BLAS takes a transposed matrix as is, so the gate usually rejects it.

Not done, and why:
* A weight kept pre-transposed for inference (a cached ``W.t().contiguous()``): ``fuse_linear``
  (earlier in the order) already turns ``x @ W.t()`` into ``F.linear(x, W)``, which reads the
  weight in its stored layout; a cache would also have to track ``W`` being reloaded. A
  transposed weight that is still there is treated like any view: copied in the graph, from the
  live parameter, at every call, and kept only if the gate measures that faster.
* ``torch_npu.npu_format_cast(W, 29)`` (FRACTAL_NZ) for matmul/linear weights: with A2/A3's
  default ``allow_internal_format=False`` no NZ tensor is created and NZ inputs are converted back
  to ND (§1.16), so a cast in the graph only adds a TransData per call; a one-time cast would
  have to change the user's parameters or keep a second copy of every weight, and enabling
  internal formats is documented to cause precision anomalies (§9 pitfall 11). torch_npu picks
  internal formats for Linear itself where they are enabled.

Safe when: the view's strides are known (example inputs), it is not already contiguous, the model
does not itself call ``.contiguous()`` on it, and nothing writes in place between the view and its
last rerouted reader (the copy is taken at the view, so a later write would not reach it); with
a reshape or flatten reader (whose output may be a view of the base, not of the copy), nothing
writes in place after the view at all.
Contract: exact (the same values, in another memory layout).
Devices: cpu, cuda, npu.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.capture.ir import (
    TensorInfo,
    is_op,
    mark_new_node,
    op_name,
    tensor_info,
    writes_in_place,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass

# Ops whose output is a view of their input that may be strided.
VIEW_OPS = frozenset({"transpose", "permute", "t", "mT", "expand", "expand_as", "getitem", "narrow",
                      "select", "movedim", "swapaxes", "swapdims", "unfold", "diagonal", "as_strided"})
# Readers that copy a strided input into contiguous memory before computing. The first group
# makes one reader enough (the list: the GEMM, convolution and reshape family).
CORE_READERS = frozenset({"matmul", "bmm", "linear", "conv", "reshape"})
OTHER_READERS = frozenset({"flatten", "addmm", "baddbmm", "layer_norm", "group_norm"})
# call_function spellings that rewriter.capture.ir.op_name does not name.
_EXTRA_FUNCTIONS = {torch.flatten: "flatten", torch.baddbmm: "baddbmm", F.layer_norm: "layer_norm",
                    F.group_norm: "group_norm", torch.narrow: "narrow", torch.select: "select",
                    torch.movedim: "movedim", torch.swapaxes: "swapaxes", torch.diagonal: "diagonal"}



def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def as_contiguous(info: TensorInfo) -> TensorInfo:
    """``info`` with row-major strides: what ``.contiguous()`` of that tensor gives."""
    return dataclasses.replace(info, stride=contiguous_strides(info.shape))


def is_contiguous(info: TensorInfo) -> bool:
    """Row-major on every dimension of size > 1 (a size-1 dimension's stride is arbitrary)."""
    return all(s == e for size, s, e in zip(info.shape, info.stride, contiguous_strides(info.shape))
               if size > 1)


def _name(node: Node) -> str | None:
    if node.op == "call_function":
        try:
            return op_name(node) or _EXTRA_FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    return op_name(node)


def readers_needing_contiguous(view: Node) -> list[Node]:
    return [u for u in view.users if _name(u) in CORE_READERS | OTHER_READERS]


def can_make_contiguous(view: Node, order: dict[Node, int]) -> tuple[list[Node], str]:
    """The readers to reroute to one contiguous copy of ``view``, or [] and why not."""
    if _name(view) not in VIEW_OPS:
        return [], "not a view op"
    info = tensor_info(view)
    if info is None:
        return [], "strides unknown"
    if is_contiguous(info):
        return [], "already contiguous"
    if any(is_op(u, "contiguous") for u in view.users):
        return [], "the model makes it contiguous itself"
    readers = readers_needing_contiguous(view)
    if not (len(readers) >= 2 or any(_name(u) in CORE_READERS for u in readers)):
        return [], f"{len(readers)} reader needing contiguous memory, none a GEMM, conv or reshape"
    # A reshape or flatten of the view may itself be a view of the view's base (a split
    # dimension); of the copy, it no longer is: a write after it, into either, would reach the
    # one and not the other. Then no write may follow the view at all.
    aliasing = any(_name(u) in ("reshape", "flatten") for u in readers)
    last = len(order) if aliasing else max(order[u] for u in readers)
    if any(writes_in_place(n) for n in order if order[view] < order[n] < last):
        return [], "an in-place write after the view" + ("" if aliasing else ", before its readers")
    return readers, ""


class MakeContiguous(Pass):
    name = "make_contiguous"
    contract = "exact"
    devices = frozenset({"cpu", "cuda", "npu"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        sites = []
        for node in gm.graph.nodes:
            readers, _ = can_make_contiguous(node, order)
            if readers:
                info = tensor_info(node)
                names = ", ".join(f"{_name(u)} {u.name}" for u in readers)
                sites.append(Site(node, f"{node.name}: {_name(node)} {info.shape} made contiguous once "
                                        f"for {names}", (readers, info)))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            view: Node = site.anchor
            readers, info = site.match
            with g.inserting_after(view):
                copy = mark_new_node(g.call_method("contiguous", (view,)), self.name)
            copy.meta["tensor_info"] = as_contiguous(info)
            for reader in readers:
                reader.replace_input_with(view, copy)


register_pass(MakeContiguous())
