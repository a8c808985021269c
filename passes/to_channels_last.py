"""to_channels_last: 2-D convolutions run on channels_last (NHWC) tensors.

Rewrites (x 4-D (N, C, H, W), W (O, C/groups, kH, kW))::

    y = F.conv2d(x, W, b, ...)
  ->
    x_cl = x.contiguous(memory_format=torch.channels_last)
    W_cl = W.contiguous(memory_format=torch.channels_last)
    y = F.conv2d(x_cl, W_cl, b, ...)              # y comes out channels_last too

    return y                                       # a 4-D graph output that was contiguous
  ->
    return y.contiguous()                          # ... is handed back contiguous, as before

oneDNN (CPU) and cuDNN (CUDA) have NHWC convolution kernels that avoid the layout reorders the
NCHW path pays around each convolution; channels_last then propagates through element-wise ops,
pooling and batch norm to the next convolution, where the conversion is a no-op
(``contiguous(memory_format=...)`` returns the tensor itself when it already has that layout).
Each tensor is converted once, however many convolutions read it. The weight conversion is in
the graph at every call, from the live parameter (state_dict, gradients and weights loaded later
are the user's as before); the convolution would make the same conversion internally. Graph
outputs of rank 4 that were contiguous are made contiguous again, so a caller's ``.view()`` on
the output keeps working.
Safe when: a 4-D floating input (batched images); an input already channels_last is left.
Contract: exact (the same convolution in another memory layout; the kernel may sum in another
order, fp32 rounding only).
Devices: cpu, cuda. Not npu: its convolutions run on the device's own formats (NC1HWC0
activations, FRACTAL_Z weights; reference npu_ecosystem.md §1.16), not on NHWC.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.fx import Graph, GraphModule, Node

from passes.make_contiguous import is_contiguous
from rewriter.ir import TensorInfo, arg, hoist_reads, is_op, mark_new_node, tensor_info
from rewriter.pass_api import Pass, PassContext, Site, register_pass


def _conv2d(node: Node) -> bool:
    # op_name "conv" covers conv1d/2d/3d; F.conv2d is torch.conv2d.
    return is_op(node, "conv") and node.target is torch.conv2d


def channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def is_channels_last(info: TensorInfo) -> bool:
    """NHWC strides on every dimension of size > 1."""
    return info.ndim == 4 and all(s == e for size, s, e in
                                  zip(info.shape, info.stride, channels_last_strides(info.shape)) if size > 1)


def can_convert(conv: Node) -> str | None:
    """None when ``conv`` may run on channels_last tensors, else why not."""
    if not _conv2d(conv):
        return "not a conv2d"
    x, w = tensor_info(conv.args[0]), tensor_info(arg(conv, 1, "weight"))
    if x is None or w is None:
        return "shapes unknown"
    if x.ndim != 4:
        return f"{x.ndim}-D input (unbatched)"
    if not x.dtype.is_floating_point:
        return f"dtype {x.dtype}"
    if is_channels_last(x) and not is_contiguous(x):
        return "input already channels_last"
    return None


class ToChannelsLast(Pass):
    name = "to_channels_last"
    contract = "exact"
    devices = frozenset({"cpu", "cuda"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        return [Site(n, f"{n.name}: conv2d on {tensor_info(n.args[0]).shape} in channels_last", tensor_info(n))
                for n in gm.graph.nodes if can_convert(n) is None]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        output = next(n for n in reversed(g.nodes) if n.op == "output")
        # Read before the conv outputs' facts change to NHWC below.
        contiguous_outputs = {v: info for v in output.all_input_nodes
                              if (info := tensor_info(v)) is not None and info.ndim == 4 and is_contiguous(info)}
        converted: dict[object, Node] = {}  # one conversion per tensor
        for site in sites:
            conv: Node = site.anchor
            hoist_reads(conv, (conv.args[0], arg(conv, 1, "weight")))
            args = list(conv.args)
            args[0] = self._convert(g, args[0], converted)
            if len(args) > 1:
                args[1] = self._convert(g, args[1], converted)
            else:
                conv.kwargs = {**conv.kwargs, "weight": self._convert(g, conv.kwargs["weight"], converted)}
            conv.args = tuple(args)
            conv.meta["rewriter_pass"] = self.name
            out: TensorInfo | None = site.match
            if out is not None:  # the output is NHWC now; later passes read strides
                conv.meta["tensor_info"] = dataclasses.replace(out, stride=channels_last_strides(out.shape))
        # 4-D outputs that were contiguous are returned contiguous (a no-op where they still are).
        for value, info in contiguous_outputs.items():
            with g.inserting_before(output):
                restored = mark_new_node(g.call_method("contiguous", (value,)), self.name)
            restored.meta["tensor_info"] = info
            output.replace_input_with(value, restored)

    def _convert(self, g: Graph, value: Node, converted: dict[object, Node]) -> Node:
        # A parameter read twice (fx makes a get_attr per read) is still one tensor.
        key = ("attr", value.target) if value.op == "get_attr" else value
        if key not in converted:
            # Right after the producer, so every convolution reading it can use the one copy.
            anchor = value if value.op != "placeholder" else [n for n in g.nodes if n.op == "placeholder"][-1]
            with g.inserting_after(anchor):
                node = g.call_method("contiguous", (value,), {"memory_format": torch.channels_last})
            converted[key] = mark_new_node(node, self.name)
        return converted[key]


register_pass(ToChannelsLast())
