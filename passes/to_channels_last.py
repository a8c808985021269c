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
Each tensor is converted once, right before the first convolution that reads it (so after any
in-place write into it; again after a write between two such convolutions). The weight
conversion is in the graph at every call, from the live parameter (state_dict, gradients and
weights loaded later are the user's as before); the convolution would make the same conversion
internally. Graph outputs computed from a convolution that were contiguous (any rank: ``h[0]``
too) are made contiguous again, so a caller's ``.view()`` on the output keeps working; so is the
input of a ``.view()`` (or another stride reader) in the graph (``h.view(n, -1)`` raises on an
NHWC ``h``).
Safe when: a 4-D floating input (batched images); an input already channels_last is left. Not
done at all (the graph is left as it is) when something writes in place after such a
``.view()``: the view is then of a contiguous copy, and the write would reach only one of them.
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
from rewriter.capture.ir import (
    TensorInfo,
    arg,
    hoist_reads,
    is_op,
    mark_new_node,
    tensor_info,
    written_between,
)
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
    x, w = tensor_info(arg(conv, 0, "input")), tensor_info(arg(conv, 1, "weight"))
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
    scope = "step"  # no local region: measured on the whole step
    contract = "exact"
    devices = frozenset({"cpu", "cuda"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = [Site(n, f"{n.name}: conv2d on {tensor_info(arg(n, 0, 'input')).shape} in channels_last",
                      tensor_info(n))
                 for n in gm.graph.nodes if can_convert(n) is None]
        # A .view() of a (now NHWC) conv result is taken of a contiguous copy; a write after it
        # would reach the copy or the original, not both as before: then leave the graph alone.
        if any(written_between(r) for r in layout_readers([s.anchor for s in sites])):
            return []
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        output = next(n for n in reversed(g.nodes) if n.op == "output")
        # Read before the conv outputs' facts change to NHWC below.
        computed = computed_from([s.anchor for s in sites])
        contiguous_outputs = {v: info for v in output.all_input_nodes
                              if v in computed and (info := tensor_info(v)) is not None and is_contiguous(info)}
        converted: dict[object, Node] = {}  # one conversion per tensor
        for site in sites:
            conv: Node = site.anchor
            hoist_reads(conv, (arg(conv, 0, "input"), arg(conv, 1, "weight")))
            args, kwargs = list(conv.args), dict(conv.kwargs)
            for i, name in enumerate(("input", "weight")):
                if len(args) > i:
                    args[i] = self._convert(g, args[i], conv, converted)
                else:
                    kwargs[name] = self._convert(g, kwargs[name], conv, converted)
            conv.args, conv.kwargs = tuple(args), kwargs
            conv.meta["rewriter_pass"] = self.name
            out: TensorInfo | None = site.match
            if out is not None:  # the output is NHWC now; later passes read strides
                conv.meta["tensor_info"] = dataclasses.replace(out, stride=channels_last_strides(out.shape))
        # Layout readers (.view()) of what the convolutions computed read it contiguous, as before.
        for reader in layout_readers([s.anchor for s in sites]):
            with g.inserting_before(reader):
                restored = mark_new_node(g.call_method("contiguous", (reader.args[0],)), self.name)
            reader.replace_input_with(reader.args[0], restored)
        # Outputs that were contiguous are returned contiguous (a no-op where they still are).
        for value, info in contiguous_outputs.items():
            with g.inserting_before(output):
                restored = mark_new_node(g.call_method("contiguous", (value,)), self.name)
            restored.meta["tensor_info"] = info
            output.replace_input_with(value, restored)

    def _convert(self, g: Graph, value: Node, conv: Node, converted: dict[object, Node]) -> Node:
        # A parameter read twice (fx makes a get_attr per read) is still one tensor.
        key = ("attr", value.target) if value.op == "get_attr" else value
        if key in converted and written_between(converted[key], conv):
            del converted[key]  # written in place since that copy: it is stale
        if key not in converted:
            # Right before the first convolution reading it (after any write into it before);
            # later convolutions reading it use the one copy.
            with g.inserting_before(conv):
                node = g.call_method("contiguous", (value,), {"memory_format": torch.channels_last})
            converted[key] = mark_new_node(node, self.name)
        return converted[key]


# Readers whose result depends on the strides of their input, not only on its values.
_LAYOUT_METHODS = frozenset({"view", "view_as", "as_strided", "stride", "is_contiguous", "data_ptr"})


def computed_from(convs: list[Node]) -> set[Node]:
    """The convolutions and every node computed from their results (channels_last propagates
    through element-wise ops, pooling, norms)."""
    derived, frontier = set(convs), list(convs)
    while frontier:
        for u in frontier.pop().users:
            if u not in derived:
                derived.add(u)
                frontier.append(u)
    return derived


def layout_readers(convs: list[Node]) -> list[Node]:
    """Readers of the strides (``h.view(n, -1)``: raises on an NHWC ``h``) of what ``convs``
    computed, in graph order."""
    derived = computed_from(convs)
    return [u for u in convs[0].graph.nodes if u in derived and u.args and u.args[0] in derived
            and ((u.op == "call_method" and u.target in _LAYOUT_METHODS)
                 or (u.op == "call_function" and u.target is torch.as_strided))] if convs else []


register_pass(ToChannelsLast())
