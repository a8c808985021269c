"""cast_to_half: automatic mixed precision written into the graph (only with optimize(dtype=...)).

Rewrites each operator on the half list (``rewriter.devices.amp.HALF_OPS``: linear, matmul, bmm, conv,
attention, ...) to take its floating inputs in the half dtype, and each operator on the fp32 list
(``rewriter.devices.amp.FLOAT_OPS``: softmax, norms, reductions, exp/log, losses) to take them in fp32::

    y = F.linear(x, w, b)          ->  y = F.linear(x.to(bf16), w.to(bf16), b.to(bf16))
    p = F.softmax(s, -1)           ->  p = F.softmax(s.to(float32), -1)     (s was half)

Everything else runs in whatever its inputs are (type promotion, as autocast does). An operator
that reads integer values held as floats (``position_ids.float()``, moved or reshaped) stays
fp32: bf16 holds integers exactly only up to 256 (fp16: 2048), so rotary angles computed from
positions in half would be wrong. Models write such an op inside ``torch.autocast(enabled=False)``
(transformers' rotary ``inv_freq @ positions``), which leaves no trace in a graph captured without
autocast; the integer origin is in the graph. A fill the model wrote as ``torch.finfo(x.dtype).min``
is fp32's value in a graph captured in fp32, which ``masked_fill`` on a half tensor refuses
(DeBERTa-v2's masked scores): such a fill (``amp.SATURATED_FILLS``) takes its value saturated to
its tensor's dtype at run time, the half dtype's ``finfo.min`` as the model in that dtype writes it. In
inference a model tensor (a weight) is cast once, not at every call
(``rewriter.devices.weight_casts.WeightCast``: ``w16 = self.rewriter_weight_cast_bfloat16(w)``). A tensor
is cast at most once per dtype (``w.to(bf16)`` is shared by every user of ``w``), so the
rewritten graph's code shows each cast exactly where it happens; a cast of a tensor that
already has the dtype costs nothing at run time (``Tensor.to`` returns it). The lists are the user's to
change (``rewriter.devices.amp.register_half_function`` / ``register_float_function``).
Safe when: the graph's floating tensors are fp32 (a model already in half precision is left).
Contract: reduced (half-precision GEMMs): only with ``optimize(dtype=torch.bfloat16 | float16)``,
verified at that dtype's tolerance. fp16 training also gets dynamic loss scaling (rewriter.devices.amp).
Devices: cpu (bf16, where the CPU has AMX/AVX512-BF16), cuda, npu (fp16; bf16 where supported).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from rewriter.capture.ir import CAST_OPS, arg, mark_new_node, op_name, reads_model_tensor, tensor_info
from rewriter.devices import amp
from rewriter.devices.weight_casts import WeightCast
from rewriter.pass_api import Pass, PassContext, Site, register_pass


def _floating(value: object) -> bool:
    info = tensor_info(value)
    return info is not None and info.dtype.is_floating_point


def _known_dtype(value: Node, half: torch.dtype, region: bool = False) -> torch.dtype | None:
    """The dtype ``value`` certainly has once the casts are in, or None when it depends.

    Only what is certain: a half-list op makes half, an fp32-list op fp32, an explicit cast its
    dtype, a parameter its own, an input its own unless ``region`` (a region graph measured
    under the precision overlay gets its inputs as the overlaid model makes them, half where a
    half-list op made them: an fp32-list op on one must cast it, as it does in the model, or
    the region's original form runs that op in half and is timed for what the model does not
    run). Anything else gets a cast, which costs nothing when the tensor already has that
    dtype (``Tensor.to`` returns it unchanged).
    """
    precision = amp.precision_of(value) if value.op in ("call_function", "call_method") else None
    if precision == "half":
        return half
    if precision == "float":
        return torch.float32
    if value.op == "call_method" and value.target == "to" and isinstance(value.args[-1], torch.dtype):
        return value.args[-1]
    if value.op == "get_attr" or (value.op == "placeholder" and not region):
        info = tensor_info(value)
        return info.dtype if info is not None else None
    return None


# Ops that move, reshape or recast values without computing new ones: integers stay integers.
_MOVES_VALUES = frozenset({"getitem", "view", "reshape", "expand", "expand_as", "transpose", "permute",
                           "t", "mT", "unsqueeze", "squeeze", "contiguous", "clone", "flatten",
                           "repeat", "narrow", "select", *CAST_OPS})


def _integer_valued(value: Node, steps: int = 32) -> bool:
    """``value`` is a floating copy of an integer tensor (positions, counts), moved or reshaped."""
    for _ in range(steps):
        info = tensor_info(value)
        if info is not None and not info.dtype.is_floating_point and not info.dtype.is_complex:
            return True
        if value.op not in ("call_function", "call_method") or op_name(value) not in _MOVES_VALUES:
            return False
        source = next((a for a in value.args if isinstance(a, Node)), None)
        if source is None:
            return False
        value = source
    return False


def _tensor_args(node: Node) -> list[Node]:
    found: list[Node] = []
    for a in list(node.args) + list(node.kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        found += [x for x in items if isinstance(x, Node) and _floating(x)]
    return list(dict.fromkeys(found))


class CastToHalf(Pass):
    name = "cast_to_half"
    scope = "step"  # the precision of the whole graph: measured on the whole step
    sets_precision = True
    # 2: inference casts model tensors once (WeightCast); 3: integer values stay fp32; 4: in a
    # region graph an fp32-list op casts its inputs (they may arrive half); 5: a fill out of the
    # half dtype's range saturates
    version = 5
    contract = "reduced"
    devices = frozenset({"cpu", "cuda", "npu"})

    def applies_to(self, ctx: PassContext) -> str | None:
        why = super().applies_to(ctx)
        if why is None and ctx.dtype not in ctx.backend.amp_dtypes:
            # NPU: bfloat16 only where torch.npu.is_bf16_supported() (reference §2.4)
            why = f"{ctx.dtype} is not a fast autocast dtype on {ctx.backend.name} here " \
                  f"(it offers {', '.join(str(d) for d in ctx.backend.amp_dtypes) or 'none'})"
        return why

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if ctx.dtype not in ctx.backend.amp_dtypes:
            return []  # e.g. fp16 on a CPU: no fast half GEMMs to gain
        if not ctx.region and any(_floating(n) and tensor_info(n).dtype != torch.float32
                                  for n in gm.graph.nodes if n.op == "placeholder"):
            return []  # already mixed or half: leave the user's choice alone
        sites = []
        for node in gm.graph.nodes:
            precision = amp.precision_of(node) if node.op in ("call_function", "call_method") else None
            if precision is None:
                continue
            if precision == "half" and any(_integer_valued(a) for a in _tensor_args(node)):
                continue  # integer values in half lose exactness (module docstring)
            want = ctx.dtype if precision == "half" else torch.float32
            casts = [a for a in _tensor_args(node) if _known_dtype(a, ctx.dtype, ctx.region) != want]
            if casts:
                label = str(want).replace("torch.", "")
                sites.append(Site(node, f"{node.name}: {label}{amp.forced_note(node)}", (want, casts)))
        for node in gm.graph.nodes:  # a fill value out of the half dtype's range (module docstring)
            value = _fill_value(node)
            if value is not None and abs(value) > torch.finfo(ctx.dtype).max:
                sites.append(Site(node, f"{node.name}: fill value {value:g} saturated to its tensor's dtype",
                                  (_SATURATE, value)))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        made: dict[tuple[Node, torch.dtype], Node] = {}
        for site in sites:
            node: Node = site.anchor
            if site.match[0] is _SATURATE:
                _saturate(gm, node, site.match[1])
                continue
            want, casts = site.match
            for value in casts:
                key = (value, want)
                if key not in made:  # one cast per tensor and dtype
                    with g.inserting_after(_after_placeholders(g) if value.op == "placeholder" else value):
                        made[key] = mark_new_node(_cast(gm, value, want, ctx), self.name)
                cast = made[key]
                node.args = _replace(node.args, value, cast)
                node.kwargs = {k: _replace(v, value, cast) if isinstance(v, (list, tuple)) else
                               (cast if v is value else v) for k, v in node.kwargs.items()}
            node.meta["rewriter_pass"] = self.name


_SATURATE = "saturate"  # a site's match: the fill whose value is saturated, not a cast


def _fill_value(node: Node) -> float | None:
    """The scalar a fill operator (``amp.SATURATED_FILLS``) writes, or None."""
    name = op_name(node) if node.op in ("call_function", "call_method") else None
    if name not in amp.SATURATED_FILLS:
        return None
    value = arg(node, amp.SATURATED_FILLS[name][0], "value")
    return value if isinstance(value, float) else None


def _saturate(gm: GraphModule, node: Node, value: float) -> None:
    """The fill as ``amp.masked_fill_saturated(x, mask, value)``: fp32's ``finfo.min``, which a
    graph captured in fp32 holds where the model wrote ``torch.finfo(x.dtype).min``, becomes the
    half dtype's where ``x`` is half (masked_fill raises on a value its dtype cannot hold);
    where ``x`` stays fp32, the value is as it was."""
    saturated = amp.SATURATED_FILLS[op_name(node)][1]  # type: ignore[index]
    x, mask = node.args[0], arg(node, 1, "mask")
    with gm.graph.inserting_after(node):
        new = mark_new_node(gm.graph.call_function(saturated, (x, mask, value)), CastToHalf.name,
                            like=node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _cast(gm: GraphModule, value: Node, want: torch.dtype, ctx: PassContext) -> Node:
    """``value.to(want)``; in inference, a model tensor to a half dtype goes through a
    :class:`~rewriter.devices.weight_casts.WeightCast` (cast once, not at every call)."""
    if ctx.training or want == torch.float32 or not reads_model_tensor(value):
        return gm.graph.call_method("to", (value, want))
    name = f"rewriter_weight_cast_{str(want).replace('torch.', '')}"
    if not isinstance(getattr(gm, name, None), WeightCast):
        gm.add_submodule(name, WeightCast(want))
    return gm.graph.call_module(name, (value,))


def _after_placeholders(g: object) -> Node:
    """The last placeholder: graph inputs stay together at the top."""
    return [n for n in g.nodes if n.op == "placeholder"][-1]  # type: ignore[attr-defined]


def _replace(args: object, old: Node, new: Node) -> object:
    if isinstance(args, tuple):
        return tuple(_replace(a, old, new) for a in args)
    if isinstance(args, list):
        return [_replace(a, old, new) for a in args]
    return new if args is old else args


register_pass(CastToHalf())
