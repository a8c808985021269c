"""fuse_confusion_transpose: transpose/permute and reshape/view into one NPU kernel (NPU only).

Rewrites (the head split and merge around attention)::

    x.transpose(1, 2)[.contiguous()].reshape(B, S, H)   -> torch_npu.npu_confusion_transpose(x, perm, [B, S, H], True)
    x.view(B, S, N, D).transpose(1, 2)                  -> torch_npu.npu_confusion_transpose(x, perm, [B, S, N, D], False)

(reference npu_ecosystem.md §1.10; the advisor's ``(permute|transpose)-(contiguous){0,1}-(reshape|view)``
patterns, §4.2). The op is marked for planned deprecation in favour of view+permute, which is why
this is gated like every other pass: kept only where it measures faster on the device.
Safe when: the target shape is static (constants in the graph), the intermediate feeds only the
reshape/permute.
Contract: exact (data movement only).
Devices: npu.
"""
from __future__ import annotations

from torch.fx import GraphModule, Node

from rewriter.ir import is_op, op_name, replace_node, single_user, tensor_info
from rewriter.pass_api import Pass, PassContext, Site, register_pass


def _perm_of(node: Node) -> list[int] | None:
    info = tensor_info(node.args[0])
    if info is None:
        return None
    n = info.ndim
    if op_name(node) == "transpose":
        a, b = node.args[1] % n, node.args[2] % n
        perm = list(range(n))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    dims = node.args[1:] if len(node.args) > 2 else node.args[1]
    dims = list(dims) if isinstance(dims, (list, tuple)) else None
    return [d % n for d in dims] if dims and all(isinstance(d, int) for d in dims) else None


def _static_shape(node: Node) -> list[int] | None:
    dims = node.args[1:] if len(node.args) > 2 else node.args[1]
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    info = tensor_info(node)
    if info is None or not all(isinstance(d, int) for d in dims):
        return None  # shape computed at run time: a baked-in shape would be wrong for others
    return list(info.shape)


def match(node: Node) -> tuple[Node, list[int], list[int], bool, list[Node]] | None:
    """(x, perm, shape, transpose_first, dead) for a permute→reshape or reshape→permute pair."""
    if is_op(node, "reshape", "view"):
        src, dead = node.args[0], []
        if is_op(src, "contiguous") and single_user(src, node):
            dead, src = [src], src.args[0]
        if is_op(src, "transpose", "permute") and single_user(src, dead[0] if dead else node):
            perm, shape = _perm_of(src), _static_shape(node)
            if perm is not None and shape is not None:
                return src.args[0], perm, shape, True, [src] + dead
    if is_op(node, "transpose", "permute"):
        src = node.args[0]
        if is_op(src, "reshape", "view") and single_user(src, node):
            perm, shape = _perm_of(node), _static_shape(src)
            if perm is not None and shape is not None:
                return src.args[0], perm, shape, False, [src]
    return None


class FuseConfusionTranspose(Pass):
    name = "fuse_confusion_transpose"
    contract = "exact"
    devices = frozenset({"npu"})
    fused_kind = "confusion_transpose"

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if not ctx.backend.offers("confusion_transpose"):
            return []
        sites = []
        for node in gm.graph.nodes:
            m = match(node)
            info = tensor_info(m[0]) if m is not None else None
            why = ctx.backend.cannot_take("confusion_transpose", info.dtype) if info is not None else None
            if why is not None:
                ctx.decline(f"{self.name} at {node.name}", why)
            elif m is not None:
                sites.append(Site(node, f"{node.name}: {'permute then reshape' if m[3] else 'reshape then permute'}", m))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            x, perm, shape, first, dead = site.match
            node: Node = site.anchor
            with g.inserting_before(node):
                new = ctx.backend.emit_confusion_transpose(g, x, perm, shape, first)
            replace_node(node, new, self.name, list(reversed(dead)))


register_pass(FuseConfusionTranspose())
