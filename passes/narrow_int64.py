"""narrow_int64: int64 index arithmetic whose values provably fit into int32, computed in int32.

Rewrites (``n`` a static int or a ``size()`` read; the arithmetic with int constants)::

    pos = torch.arange(n) + 2                     dt = int32_if_sizes_fit(n)    # only for size() reads
    keep = pos[None, :] <= pos[:, None]     ->    pos = torch.arange(n, dtype=dt) + 2
    out = torch.gather(x, 1, pos.expand(b, -1))   keep = pos[None, :] <= pos[:, None]
    e = F.embedding(pos, W)                       out = torch.gather(x, 1, pos.expand(b, -1).to(torch.int64))
                                                  e = F.embedding(pos, W)

The NPU's AI Core has no int64 arithmetic for many operators: they fall back to the AI CPU
(tuning guide 调优手段1; reference npu_ecosystem.md §6, advisor AICPU rules: e.g. TensorEqual
int64 -> AI CPU). In int32 they stay on the AI Core.

Range analysis: an interval per value. Sources: ``torch.arange`` with int bounds and a positive
constant step. Ints: literals, and ``x.size(d)`` / ``x.shape[d]`` reads, assumed in
``[0, MAX_SIZE]``. Propagated through ``+ - * neg // %`` (constant positive divisor) and through
value-preserving ops (view, reshape, expand, unsqueeze, slicing, transpose, ...). A value is
narrowed only when its interval, and that of every int operand it meets, fits int32. Anything
else (an int64 graph input such as token ids, a tensor of unknown values) is left as it is.
The ``size()`` assumption is checked at run time, on the host, by ``int32_if_sizes_fit``: when a
call's sizes exceed MAX_SIZE, the chain runs in int64 exactly as before. Sizes baked in by
Dynamo are constants and need no check.

Where a narrowed value leaves the chain it is cast back with ``.to(torch.int64)``, one cast per
value, except into readers that take int32 and give the same result: comparisons (bool out;
not with a Python int or 0-d int64 tensor that int32 cannot hold, or a host int of unknown
range: an int32 tensor compares with those in int32),
``F.embedding`` indices and ``index_select`` indices (both documented for IntTensor or
LongTensor). gather/scatter/indexing and graph outputs get int64, as before.
Only chains with int64 arithmetic or comparisons are rewritten (an arange straight into an
embedding runs nothing on the AI CPU). A chain with an in-place write is left alone.
Contract: exact (integer arithmetic; no value changes).
Devices: npu (the target), and cpu/cuda where the gate measures it faster (it usually does not:
their int64 arithmetic runs at full speed).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from rewriter.capture.ir import arg, mark_new_node, op_name, tensor_info, writes_in_place
from rewriter.pass_api import Pass, PassContext, Site, register_pass

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Bound assumed for a size() read; checked at run time, so it only limits what is narrowed.
MAX_SIZE = 2**20

_ARITHMETIC = {operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
               operator.mul: "mul", torch.mul: "mul", operator.neg: "neg", torch.neg: "neg",
               operator.floordiv: "floordiv", torch.floor_divide: "floordiv",
               operator.mod: "mod", torch.remainder: "mod"}
_ARITHMETIC_METHODS = {"add": "add", "sub": "sub", "mul": "mul", "neg": "neg",
                       "floor_divide": "floordiv", "remainder": "mod"}
_COMPARISONS = {operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
                torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge}
_COMPARISON_METHODS = {"eq", "ne", "lt", "le", "gt", "ge"}
# Ops whose output holds (some of) the values of their first argument, unchanged.
_VALUE_PRESERVING = {"view", "reshape", "expand", "expand_as", "view_as", "reshape_as", "unsqueeze",
                     "squeeze", "flatten", "transpose", "permute", "t", "contiguous", "clone",
                     "getitem", "narrow", "select", "repeat", "flip", "detach"}
_VALUE_PRESERVING_FUNCTIONS = {torch.flatten: "flatten", torch.unsqueeze: "unsqueeze",
                               torch.squeeze: "squeeze", torch.narrow: "narrow", torch.select: "select",
                               torch.flip: "flip", torch.clone: "clone"}
# Ops reading another tensor only for its shape.
_SHAPE_OF_OTHER = {"expand_as", "view_as", "reshape_as"}


@dataclass(frozen=True)
class Interval:
    """All values lie in [lo, hi], provided every size() read in ``sizes`` is <= MAX_SIZE."""

    lo: int
    hi: int
    sizes: frozenset = field(default_factory=frozenset)

    def fits_int32(self) -> bool:
        return INT32_MIN <= self.lo and self.hi <= INT32_MAX

    def combine(self, other: "Interval", fn: Any) -> "Interval":
        ends = [fn(a, b) for a in (self.lo, self.hi) for b in (other.lo, other.hi)]
        return Interval(min(ends), max(ends), self.sizes | other.sizes)


def int32_if_sizes_fit(*sizes: int) -> torch.dtype:
    """torch.int32 when every size read is within the bound the range proof assumed, else int64
    (the rewritten chain then computes exactly what the original did). Host ints only: no sync."""
    return torch.int32 if all(0 <= s <= MAX_SIZE for s in sizes) else torch.int64


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int64_tensor(node: Any) -> bool:
    info = tensor_info(node)
    return info is not None and info.dtype == torch.int64


def _size_read(node: Node) -> bool:
    """``x.size(d)`` or ``x.shape[d]`` / ``x.size()[d]`` of a tensor ``x``: a host int."""
    if node.op == "call_method" and node.target == "size" and len(node.args) == 2:
        return _is_int(node.args[1])
    if node.op == "call_function" and node.target is operator.getitem and _is_int(node.args[1]):
        src = node.args[0]
        return isinstance(src, Node) and (
            (src.op == "call_function" and src.target is getattr and src.args[1] == "shape")
            or (src.op == "call_method" and src.target == "size" and len(src.args) == 1))
    return False


def _arithmetic(node: Node) -> str | None:
    if node.op == "call_function":
        try:
            return _ARITHMETIC.get(node.target)
        except TypeError:
            return None
    if node.op == "call_method":
        return _ARITHMETIC_METHODS.get(node.target)  # type: ignore[arg-type]
    return None


def _comparison(node: Node) -> bool:
    if node.op == "call_function":
        try:
            return node.target in _COMPARISONS
        except TypeError:
            return False
    return node.op == "call_method" and node.target in _COMPARISON_METHODS


def _value_preserving(node: Node) -> str | None:
    if node.op == "call_function":
        try:
            name = _VALUE_PRESERVING_FUNCTIONS.get(node.target) or op_name(node)
        except TypeError:
            return None
    else:
        name = op_name(node)
    return name if name in _VALUE_PRESERVING else None


def _written_in_place(members: list[Node]) -> bool:
    """Some node writes into a chain value or into anything computed from one (which may be a
    view of it: after narrowing, readers outside the chain see a copy, so the write would no
    longer reach the chain)."""
    derived, frontier = set(members), list(members)
    while frontier:
        for u in frontier.pop().users:
            if writes_in_place(u) and u.args and u.args[0] in derived:
                return True
            if u not in derived:
                derived.add(u)
                frontier.append(u)
    return False


def _apply_op(kind: str, operands: list[Interval], divisor: Any) -> Interval | None:
    if kind == "neg":
        (a,) = operands
        return Interval(-a.hi, -a.lo, a.sizes)
    a, b = operands
    if kind == "add":
        return a.combine(b, operator.add)
    if kind == "sub":
        return Interval(a.lo - b.hi, a.hi - b.lo, a.sizes | b.sizes)
    if kind == "mul":
        return a.combine(b, operator.mul)
    # // and % by a positive constant: floor semantics for ints, as in Python.
    if not (_is_int(divisor) and divisor > 0):
        return None
    if kind == "floordiv":
        return Interval(a.lo // divisor, a.hi // divisor, a.sizes)
    if 0 <= a.lo and a.hi < divisor:
        return a
    return Interval(0, divisor - 1, a.sizes)


@dataclass
class Analysis:
    """Intervals of the int values, and for each narrowable tensor the operands it reads values from."""

    ranges: dict[Node, Interval] = field(default_factory=dict)
    narrowable: dict[Node, list[Node]] = field(default_factory=dict)  # node -> value inputs


def analyse(gm: GraphModule) -> Analysis:
    """Forward interval analysis over the graph (nodes are in topological order)."""
    result = Analysis()

    def interval(value: Any) -> Interval | None:
        if _is_int(value):
            return Interval(value, value)
        return result.ranges.get(value) if isinstance(value, Node) else None

    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if _size_read(node):
            result.ranges[node] = Interval(0, MAX_SIZE, frozenset({node}))
            continue
        kind = _arithmetic(node)
        is_tensor = _is_int64_tensor(node)
        if kind is not None and not is_tensor and tensor_info(node) is None:
            # Host int arithmetic (x.size(1) + 1): ranges only, nothing to narrow.
            operands = [interval(a) for a in node.args]
            if not node.kwargs and None not in operands:
                iv = _apply_op(kind, operands, node.args[-1])  # type: ignore[arg-type]
                if iv is not None:
                    result.ranges[node] = iv
            continue
        if not is_tensor:
            continue
        found = _tensor_interval(node, kind, interval, result)
        if found is not None and found[0].fits_int32():
            result.ranges[node], result.narrowable[node] = found
    return result


def _tensor_interval(node: Node, kind: str | None, interval: Any,
                     result: Analysis) -> tuple[Interval, list[Node]] | None:
    """The interval of int64 tensor ``node`` and the narrowable tensors it reads, if provable."""
    if node.op == "call_function" and node.target is torch.arange:
        if node.kwargs.get("dtype") not in (None, torch.int64) or "out" in node.kwargs:
            return None
        bounds = list(node.args) + [node.kwargs[k] for k in ("start", "end", "step") if k in node.kwargs]
        if len(node.args) != len(bounds) or not 1 <= len(bounds) <= 3:
            return None  # start/end/step as keywords: rare; left alone
        start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (list(bounds) + [1])[:3]
        lo, hi = interval(start), interval(end)
        if lo is None or hi is None or not (_is_int(step) and step > 0):
            return None
        if not (lo.fits_int32() and hi.fits_int32()):
            return None
        return Interval(lo.lo, max(lo.lo, hi.hi - 1), lo.sizes | hi.sizes), []
    if kind is not None:
        if node.kwargs:
            return None  # alpha=, out=: not plain arithmetic
        operands = [interval(a) for a in node.args]
        if None in operands or not all(iv.fits_int32() for iv in operands):  # type: ignore[union-attr]
            return None  # an int64 tensor of unknown values, or a scalar int32 cannot hold
        tensors = [a for a in node.args if isinstance(a, Node) and a in result.narrowable]
        if not tensors:
            return None
        iv = _apply_op(kind, operands, node.args[-1])  # type: ignore[arg-type]
        return (iv, tensors) if iv is not None else None
    name = _value_preserving(node)
    if name is None or not node.args or node.args[0] not in result.narrowable:
        return None
    shape_only = node.args[1] if name in _SHAPE_OF_OTHER and len(node.args) > 1 else None
    others = [n for n in node.all_input_nodes if n is not node.args[0] and n is not shape_only]
    if any(tensor_info(n) is not None for n in others):
        return None  # indexed by a tensor, or another tensor's values involved
    return result.ranges[node.args[0]], [node.args[0]]


def _compares_in_range(user: Node, value: Node, narrowed: set) -> bool:
    """Every other operand of comparison ``user`` leaves the int32 ``value`` compared exactly: an
    int32 tensor with a Python int, or with a 0-d int64 tensor, computes in int32 (the other value
    wraps: ``pos < 2**32`` is all False); a float, a bool, a narrowed value or a tensor with
    dimensions (which promotes) does not."""
    for other in list(user.args) + list(user.kwargs.values()):
        if other is value or other in narrowed or isinstance(other, (bool, float)):
            continue
        if _is_int(other):
            if not INT32_MIN <= other <= INT32_MAX:
                return False
            continue
        info = tensor_info(other)
        if info is None:  # a host int of unknown range, or a tensor of unknown dtype
            return False
        if info.ndim == 0 and not info.dtype.is_floating_point and info.dtype != torch.bool:
            return False
    return True


def _takes_int32(user: Node, value: Node, narrowed: set = frozenset()) -> bool:
    """``user`` gives the same result for ``value`` in int32 as in int64 (``narrowed``: the
    values that are int32 too)."""
    if _comparison(user):
        return _compares_in_range(user, value, narrowed)  # bool out; other ints promote
    if user.op == "call_function" and user.target is F.embedding:
        return arg(user, 0, "input") is value and arg(user, 1, "weight") is not value
    if op_name(user) == "index_select":  # x.index_select(dim, index)
        return arg(user, 2, "index") is value and user.args[0] is not value
    return False


@dataclass
class Chain:
    nodes: list[Node]           # graph order
    sources: list[Node]         # the aranges
    sizes: list[Node]           # size() reads the proof assumes <= MAX_SIZE
    exits: dict[Node, list[Node]]  # narrowed node -> readers that need int64 back
    ranges: dict[Node, Interval]


def chains(gm: GraphModule) -> tuple[list[Chain], list[str]]:
    """Connected groups of narrowable nodes worth narrowing, and why others were declined."""
    a = analyse(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    parent = {n: n for n in a.narrowable}

    def root(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node, inputs in a.narrowable.items():
        for i in inputs:
            parent[root(i)] = root(node)
    groups: dict[Node, list[Node]] = {}
    for n in a.narrowable:
        groups.setdefault(root(n), []).append(n)

    found, declined = [], []
    for members in groups.values():
        members.sort(key=order.__getitem__)
        member_set = set(members)
        exits: dict[Node, list[Node]] = {}
        arithmetic = compares = False
        for n in members:
            arithmetic |= _arithmetic(n) is not None
            for u in n.users:
                if u in member_set and n in a.narrowable[u]:
                    continue
                takes = _takes_int32(u, n, member_set)
                compares |= takes and _comparison(u)
                if not takes:
                    exits.setdefault(n, []).append(u)
        label = members[0].name
        if not (arithmetic or compares):
            continue  # nothing of it runs int64 arithmetic: nothing to gain
        if _written_in_place(members):
            declined.append(f"{label}: written in place (directly or through a view)")
            continue
        sources = [n for n in members if n.target is torch.arange]
        sizes = sorted({s for n in members for s in a.ranges[n].sizes}, key=order.__getitem__)
        if sizes and max(order[s] for s in sizes) > order[sources[0]]:
            declined.append(f"{label}: a size is read after the first arange")
            continue
        examples = [s.meta.get("host_scalar") for s in sizes]
        if not all(_is_int(v) and v <= MAX_SIZE for v in examples):
            declined.append(f"{label}: example sizes {examples} not known within {MAX_SIZE}")
            continue
        found.append(Chain(members, sources, sizes, exits, {n: a.ranges[n] for n in members}))
    return found, declined


def _covered(chain: Chain) -> tuple[Node, ...]:
    """What the rewrite changes under the same names: the chain, and the readers that take its
    int32 values as they are (a comparison, an embedding): the site's region (rewriter.capture.region)."""
    members = set(chain.nodes)
    readers = [u for n in chain.nodes for u in n.users
               if u not in members and u not in chain.exits.get(n, ())]
    return tuple(dict.fromkeys(chain.nodes + readers))


class NarrowInt64(Pass):
    name = "narrow_int64"
    contract = "exact"
    devices = frozenset({"npu", "cpu", "cuda"})

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        sites = []
        for chain in chains(gm)[0]:
            ops = [n.name for n in chain.nodes if _arithmetic(n) is not None] or [chain.nodes[0].name]
            lo = min(iv.lo for iv in chain.ranges.values())
            hi = max(iv.hi for iv in chain.ranges.values())
            guard = f"; sizes checked <= {MAX_SIZE} at run time" if chain.sizes else ""
            sites.append(Site(chain.sources[0], f"{', '.join(ops)}: int64 -> int32 (values in "
                                                f"[{lo}, {hi}]{guard})", chain,
                              covers=_covered(chain)))
        return sites

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            chain: Chain = site.match
            dtype: torch.dtype | Node = torch.int32
            if chain.sizes:
                with g.inserting_before(chain.sources[0]):
                    dtype = mark_new_node(g.call_function(int32_if_sizes_fit, tuple(chain.sizes)), self.name)
            for source in chain.sources:
                source.kwargs = {**source.kwargs, "dtype": dtype}
                mark_new_node(source, self.name)
            originals = {n: tensor_info(n) for n in chain.nodes}
            for n, info in originals.items():  # later passes read int32 (what the example gives now)
                if info is not None:
                    n.meta["tensor_info"] = dataclasses.replace(info, dtype=torch.int32)
            for n, readers in chain.exits.items():
                with g.inserting_after(n):
                    back = mark_new_node(g.call_method("to", (n, torch.int64)), self.name)
                back.meta["tensor_info"] = originals[n]
                for reader in readers:
                    reader.replace_input_with(n, back)


register_pass(NarrowInt64())
