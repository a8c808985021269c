"""The normalised graph IR that every pass sees, and helpers to read it.

Both capture front-ends hand passes a ``torch.fx.GraphModule`` whose compute is written as
functional torch calls: ``torch.fx.symbolic_trace`` graphs have their ``torch.nn`` leaf modules
rewritten into ``F.*`` calls by :func:`functionalize_leaf_modules`, and Dynamo graphs already
are functional (parameters arrive as placeholders). The remaining spelling differences
(``x @ w`` vs ``torch.matmul``, ``x.transpose`` vs ``torch.transpose``) are absorbed by
:func:`op_name`, so one pattern serves both front-ends::

    >>> op_name(node)            # 'matmul' for operator.matmul, torch.matmul, Tensor.matmul
"""
from __future__ import annotations

import inspect
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

log = logging.getLogger(__name__)

# Canonical op name -> call_function targets spelling it. Methods are matched by name below.
_FUNCTION_ALIASES: dict[str, tuple[Any, ...]] = {
    "matmul": (torch.matmul, operator.matmul),
    "bmm": (torch.bmm,),
    "mm": (torch.mm,),
    "addmm": (torch.addmm,),
    "linear": (F.linear,),
    "add": (operator.add, torch.add),
    "sub": (operator.sub, torch.sub),
    "mul": (operator.mul, torch.mul),
    "div": (operator.truediv, torch.div),
    "neg": (operator.neg, torch.neg),
    "transpose": (torch.transpose,),
    "permute": (torch.permute,),
    "t": (torch.t,),
    "softmax": (F.softmax, torch.softmax),
    "dropout": (F.dropout, torch.dropout),
    "masked_fill": (torch.masked_fill,),
    "where": (torch.where,),
    "full": (torch.full,),
    "tensor": (torch.tensor,),
    "scaled_dot_product_attention": (F.scaled_dot_product_attention,),
    "pow": (torch.pow, operator.pow),
    "mean": (torch.mean,),
    "rsqrt": (torch.rsqrt,),
    "sqrt": (torch.sqrt,),
    "tanh": (torch.tanh, F.tanh),
    "sigmoid": (torch.sigmoid, F.sigmoid),
    "silu": (F.silu,),
    "gelu": (F.gelu,),
    "cat": (torch.cat, torch.concat),
    "split": (torch.split,),
    "chunk": (torch.chunk,),
    "reshape": (torch.reshape,),
    "one_hot": (F.one_hot,),
    "batch_norm": (F.batch_norm,),
    "conv": (F.conv1d, F.conv2d, F.conv3d),
    "embedding": (F.embedding,),
    "var": (torch.var,),
    "getitem": (operator.getitem,),
    "le": (operator.le, torch.le),
    "expand": (),
}
_TARGET_TO_NAME = {t: name for name, targets in _FUNCTION_ALIASES.items() for t in targets}
# Tensor methods whose name differs from the canonical op name.
_METHOD_ALIASES = {"__matmul__": "matmul", "div_": None, "truediv": "div"}


def op_name(node: Node) -> str | None:
    """Canonical name of what ``node`` computes, or None for placeholders, outputs and unknowns."""
    if node.op == "call_function":
        if node.target is getattr and len(node.args) == 2 and node.args[1] in ("T", "mT"):
            return "t" if node.args[1] == "T" else "mT"
        try:
            return _TARGET_TO_NAME.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return _METHOD_ALIASES.get(node.target, node.target)
    return None


def is_op(node: Any, *names: str) -> bool:
    return isinstance(node, Node) and op_name(node) in names


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``, given positionally at ``index`` or as a keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def call_arguments(node: Node, fn: Callable[..., Any]) -> dict[str, Any]:
    """``node``'s arguments to ``fn`` by parameter name, each given by position or keyword,
    ``fn``'s defaults filled in (a positional call, ``cross_entropy(x, t, None, None, -100)``,
    reads as a keyword one)."""
    found = {}
    for i, (name, p) in enumerate(inspect.signature(fn).parameters.items()):
        default = None if p.default is inspect.Parameter.empty else p.default
        found[name] = node.kwargs.get(name, default) if p.kind is p.KEYWORD_ONLY else arg(node, i, name, default)
    return found


@dataclass(frozen=True)
class TensorInfo:
    """Static facts about a tensor a node produced on the example inputs."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...]
    requires_grad: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorInfo":
        return cls(tuple(map(_concrete, t.shape)), t.dtype, t.device, tuple(map(_concrete, t.stride())),
                   t.requires_grad)


def _concrete(size: Any) -> Any:
    """A size as an int where Dynamo's trace fixed it (a symbol a weight's size pinned, under
    ``dynamic=True``), else as it is (an int, or a length that stays symbolic)."""
    if isinstance(size, torch.SymInt):
        fixed = size.node.maybe_as_int()
        return size if fixed is None else fixed
    return size


def tensor_info(node: Any) -> TensorInfo | None:
    """What ``node`` produced on the example inputs, when known and when it is a tensor.

    Dynamo graphs carry a FakeTensor in ``meta['example_value']``; fx captures are annotated by
    :func:`annotate_tensor_info`; nodes made by passes copy the info of the node they replace.
    """
    if not isinstance(node, Node):
        return None
    info = node.meta.get("tensor_info")
    if isinstance(info, TensorInfo):
        return info
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        try:
            return TensorInfo.of(value)
        except Exception:  # symbolic shapes (dynamic=True recompiles): facts unknown
            return None
    return None


def static_tensor(node: Any) -> torch.Tensor | None:
    """The model tensor (parameter or buffer) a node reads, when the graph reads one directly.

    Passes use it to recognise constant buffers by value (a causal ``tril`` mask); they must not
    bake values that training changes into the graph.
    """
    if isinstance(node, Node):
        value = node.meta.get("static_value")
        return value if isinstance(value, torch.Tensor) else None
    return None


def reads_model_tensor(node: Any) -> bool:
    """Whether a node is a parameter or buffer of the model (a ``get_attr``, or a graph input
    Dynamo lifted one to), whatever its value: a block graph's weights differ per instance, so
    only those every instance shares have a :func:`static_tensor`."""
    return isinstance(node, Node) and (node.meta.get("model_tensor", False) or static_tensor(node) is not None)


class _InfoRecorder(torch.fx.Interpreter):
    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op == "get_attr" and isinstance(result, torch.Tensor):
            n.meta["static_value"] = result  # the model's own tensor, by reference
        if isinstance(result, torch.Tensor):
            n.meta["tensor_info"] = TensorInfo.of(result)
        elif isinstance(result, (int, float)) and not isinstance(result, bool):
            n.meta["host_scalar"] = result  # e.g. 1/sqrt(head_dim) computed from shapes
        return result


def fill_missing_info(gm: GraphModule) -> None:
    """Give nodes that passes made a :class:`TensorInfo`, by running them on fake tensors built
    from their inputs' infos (no real compute). Only the nodes without facts run, with the
    ancestors whose facts they need: the cost of what a pass added, not of the whole graph (a
    16-layer model has 1,300 nodes, a pass adds a few dozen). Best effort: a node fake tensors
    cannot run (a data-dependent ``.item()``) keeps what it had, and so do the nodes reading
    it; passes treat unknown facts as "decline"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    missing = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
               and n.users and tensor_info(n) is None and not _known_scalar(n)]
    if not missing:
        return
    needed = _needed_for(missing)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    interp = torch.fx.Interpreter(gm)
    failed: set[Node] = set()
    for n in gm.graph.nodes:  # graph order: inputs before their users
        if n not in needed:
            continue
        try:
            if any(a in failed for a in n.all_input_nodes):
                raise _Unknown(n.name)
            for a in n.all_input_nodes:
                if a not in interp.env:
                    interp.env[a] = _fact_value(a, mode, interp)
            with mode:
                result = interp.run_node(n)
        except Exception as e:  # noqa: BLE001 (unknown facts are safe: passes decline)
            log.debug("fake-tensor propagation: %s left without facts (%s)", n.name, e)
            failed.add(n)
            continue
        interp.env[n] = result
        if isinstance(result, torch.Tensor):
            n.meta["tensor_info"] = TensorInfo.of(result)


class _Unknown(Exception):
    """A value fake tensors cannot stand in for."""


def _known_scalar(n: Node) -> bool:
    """A node whose (non-tensor) value is already known: a host scalar, or Dynamo's example."""
    example = n.meta.get("example_value")
    return "host_scalar" in n.meta or (isinstance(example, (bool, int, float))
                                       and not isinstance(example, torch.SymInt))


def _needed_for(missing: list[Node]) -> set[Node]:
    """The nodes to run: those without facts, and their inputs back to ones with facts."""
    needed, stack = set(), list(missing)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        for a in n.all_input_nodes:
            if a not in needed and tensor_info(a) is None and not _known_scalar(a) \
                    and a.op not in ("placeholder", "get_attr"):
                stack.append(a)
    return needed


def _fact_value(n: Node, mode: Any, interp: torch.fx.Interpreter) -> Any:
    """A stand-in for ``n``'s value from its facts: a fake tensor, the model's own tensor, a
    known scalar, a placeholder's default."""
    info = tensor_info(n)
    if info is not None:
        return _fake(info, mode)
    if n.op == "get_attr":
        return interp.fetch_attr(n.target)  # real: non-fake inputs are allowed
    if "host_scalar" in n.meta:
        return n.meta["host_scalar"]
    example = n.meta.get("example_value")
    if _known_scalar(n):
        return example
    if isinstance(example, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in example):
        return type(example)(_fake(TensorInfo.of(v), mode) for v in example)
    if n.op == "placeholder":
        return n.args[0] if n.args else None  # its default (an optional input left out)
    raise _Unknown(n.name)


def _fake(info: TensorInfo, mode: Any) -> torch.Tensor:
    with mode:
        return torch.empty_strided(info.shape, info.stride, dtype=info.dtype, device=info.device
                                   ).requires_grad_(info.requires_grad and info.dtype.is_floating_point)


def annotate_tensor_info(gm: GraphModule, args: tuple, kwargs: dict) -> None:
    """Run ``gm`` once on real inputs and record each node's :class:`TensorInfo`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat = list(args)
    for n in placeholders[len(args):]:
        flat.append(kwargs[n.target] if n.target in kwargs else (n.args[0] if n.args else None))
    _InfoRecorder(gm).run(*flat)


def static_number(value: Any) -> float | None:
    """A Python number, or a node that is a static scalar (``torch.full([], c)``, ``torch.tensor(c)``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if is_op(value, "full") and tuple(arg(value, 0, "size", (1,))) == () \
            and isinstance(arg(value, 1, "fill_value"), (int, float)):
        return float(arg(value, 1, "fill_value"))
    if is_op(value, "tensor") and value.args and isinstance(value.args[0], (int, float)):
        return float(value.args[0])
    return None


CAST_OPS = ("to", "type", "type_as", "float")


def is_cast(node: Any) -> bool:
    return is_op(node, *CAST_OPS)


def is_noop_cast(node: Any) -> bool:
    """A cast whose output has its input's dtype (a fp32 model's ``.to(torch.float32)``)."""
    if not is_cast(node):
        return False
    a, b = tensor_info(node), tensor_info(node.args[0])
    return a is not None and b is not None and a.dtype == b.dtype


def is_upcast_to_fp32(node: Any) -> bool:
    """A cast (``x.float()``, ``x.to(torch.float32)``, ``x.type_as(y)``, ...) of a floating
    tensor to fp32 that changes nothing else, by the captured facts of its input and output:
    same shape, strides and device. Dropping it leaves every reader a tensor laid out alike."""
    if not is_cast(node) or not node.args:
        return False
    a, b = tensor_info(node.args[0]), tensor_info(node)
    return a is not None and b is not None and a.dtype.is_floating_point and b.dtype == torch.float32 \
        and (a.shape, a.stride, a.device) == (b.shape, b.stride, b.device)


def single_user(node: Any, user: Node | None = None) -> bool:
    """``node`` has exactly one user (``user``, when given)."""
    return isinstance(node, Node) and len(node.users) == 1 and (user is None or user in node.users)


def is_parameter_like(value: Any) -> bool:
    """A graph input or an attribute read (fx ``get_attr``, Dynamo's lifted parameters)."""
    return not isinstance(value, Node) or value.op in ("get_attr", "placeholder")


def hoist_reads(anchor: Node, values: Iterable[Any]) -> None:
    """Move the ``get_attr`` nodes among ``values`` before ``anchor`` (reads have no side
    effects), so code inserted before ``anchor`` may use them."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    for v in values:
        if isinstance(v, Node) and v.op == "get_attr" and order[v] > order[anchor]:
            anchor.prepend(v)


def users_are_only(node: Node, allowed: Iterable[Node]) -> bool:
    """True when every user of ``node`` is in ``allowed`` (safe to delete along with them)."""
    allowed = set(allowed)
    return all(u in allowed for u in node.users)


def erase_if_unused(graph: Graph, nodes: Iterable[Node]) -> None:
    """Erase those of ``nodes`` left without users (in any order: erasing one may free another)."""
    pending = [n for n in dict.fromkeys(nodes) if n.graph is graph]
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if not n.users:
                graph.erase_node(n)
                pending.remove(n)
                changed = True


def replace_node(old: Node, new: Node, pass_name: str, dead: Iterable[Node] = ()) -> None:
    """Make ``new`` (already inserted) stand for ``old``: users move over, ``old`` and whatever
    in ``dead`` lost its last user are erased, and ``new`` records the pass that made it."""
    mark_new_node(new, pass_name, like=old)
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)
    erase_if_unused(new.graph, dead)


def lazy_graph_module(root: nn.Module, graph: Graph, class_name: str) -> GraphModule:
    """A GraphModule whose Python code is generated at its first call, not now (as Dynamo's
    own graphs are): most candidate graphs and region graphs are never run (a pass without
    sites, the sites a signature's representative stands for), and generating the code of a
    1,300-node graph costs more than copying it."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # a torch without it: generated now
        return GraphModule(root, graph, class_name=class_name)
    return _LazyGraphModule(root, graph, class_name=class_name)


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule with a copied graph and the same (shared) parameters and submodules."""
    graph = Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = lazy_graph_module(gm, graph, type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def mark_new_node(node: Node, pass_name: str, like: Node | None = None) -> Node:
    """Record which pass made ``node`` and copy tensor facts from the node it replaces."""
    node.meta["rewriter_pass"] = pass_name
    if like is not None:
        for key in ("tensor_info", "example_value", "val"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def structure_signature(gm: GraphModule) -> list[str]:
    """The op sequence of ``gm`` (names only), for plan fingerprints and reports."""
    sig = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            name = op_name(n) or (n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target)))
            sig.append(f"{n.op}:{name}")
    return sig


# --- fx front-end: torch.nn leaf modules -> functional calls -----------------------------------

def _linear(g: Graph, m: nn.Linear, x: Node, attr: Callable[[str], Node]) -> Node:
    bias = attr("bias") if m.bias is not None else None
    return g.call_function(F.linear, (x, attr("weight"), bias))


def _conv(fn: Callable) -> Callable:
    def emit(g: Graph, m: nn.Module, x: Node, attr: Callable[[str], Node]) -> Node | None:
        if m.padding_mode != "zeros":
            return None
        bias = attr("bias") if m.bias is not None else None
        return g.call_function(fn, (x, attr("weight"), bias, m.stride, m.padding, m.dilation, m.groups))
    return emit


def _layer_norm(g: Graph, m: nn.LayerNorm, x: Node, attr: Callable[[str], Node]) -> Node:
    w = attr("weight") if m.weight is not None else None
    b = attr("bias") if getattr(m, "bias", None) is not None else None
    return g.call_function(F.layer_norm, (x, tuple(m.normalized_shape), w, b, m.eps))


def _embedding(g: Graph, m: nn.Embedding, x: Node, attr: Callable[[str], Node]) -> Node | None:
    if m.max_norm is not None:  # renormalises the weight in place: leave it to the module
        return None
    return g.call_function(F.embedding, (x, attr("weight"), m.padding_idx, None, m.norm_type,
                                         m.scale_grad_by_freq, m.sparse))


def _dropout(g: Graph, m: nn.Dropout, x: Node, attr: Callable[[str], Node]) -> Node:
    # The training flag is baked in: a capture serves one mode (the wrapper recaptures on change).
    return g.call_function(F.dropout, (x, m.p, m.training, m.inplace))


def _batch_norm(g: Graph, m: nn.modules.batchnorm._BatchNorm, x: Node,
                attr: Callable[[str], Node]) -> Node | None:
    if not m.track_running_stats or m.running_mean is None:
        return None
    w = attr("weight") if m.affine else None
    b = attr("bias") if m.affine else None
    if not m.training:
        return g.call_function(F.batch_norm, (x, attr("running_mean"), attr("running_var"), w, b,
                                              False, 0.0, m.eps))
    if m.momentum is None:  # cumulative average reads num_batches_tracked on the host
        return None
    g.call_method("add_", (attr("num_batches_tracked"), 1))
    return g.call_function(F.batch_norm, (x, attr("running_mean"), attr("running_var"), w, b,
                                          True, m.momentum, m.eps))


def _simple(fn: Callable, *fields: str) -> Callable:
    def emit(g: Graph, m: nn.Module, x: Node, attr: Callable[[str], Node]) -> Node:
        return g.call_function(fn, (x, *(getattr(m, f) for f in fields)))
    return emit


_LEAF_EMITTERS: dict[type, Callable] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv(F.conv1d), nn.Conv2d: _conv(F.conv2d), nn.Conv3d: _conv(F.conv3d),
    nn.LayerNorm: _layer_norm,
    nn.Embedding: _embedding,
    nn.Dropout: _dropout,
    nn.BatchNorm1d: _batch_norm, nn.BatchNorm2d: _batch_norm, nn.BatchNorm3d: _batch_norm,
    nn.ReLU: lambda g, m, x, a: g.call_function(F.relu, (x,)),
    nn.GELU: lambda g, m, x, a: g.call_function(F.gelu, (x,), {"approximate": m.approximate}),
    nn.SiLU: lambda g, m, x, a: g.call_function(F.silu, (x,)),
    nn.Tanh: lambda g, m, x, a: g.call_function(torch.tanh, (x,)),
    nn.Sigmoid: lambda g, m, x, a: g.call_function(torch.sigmoid, (x,)),
    nn.Softmax: lambda g, m, x, a: g.call_function(F.softmax, (x,), {"dim": m.dim}),
    nn.Flatten: _simple(torch.flatten, "start_dim", "end_dim"),
}


def functionalize_leaf_modules(gm: GraphModule) -> list[str]:
    """Rewrite ``call_module`` nodes of ``torch.nn`` leaves into functional calls, in place.

    Returns the qualified names of modules left as ``call_module`` (no functional form, or a
    configuration whose functional form would differ), for the report.
    """
    graph = gm.graph
    left: list[str] = []
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if type(module) is nn.Identity:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        emitter = _LEAF_EMITTERS.get(type(module))
        if emitter is None or len(node.args) != 1 or node.kwargs:
            left.append(node.target)
            continue
        with graph.inserting_before(node):
            def attr(name: str, _target: str = node.target) -> Node:
                return graph.get_attr(f"{_target}.{name}")
            new = emitter(graph, module, node.args[0], attr)
        if new is None:
            left.append(node.target)
            continue
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    # get_attr nodes made above may be dead (e.g. an emitter that declined after asking).
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    gm.recompile()
    return left


# --- in-place writes ---------------------------------------------------------------------

_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.setitem}

_INPLACE_INDEX: dict[object, int | None] = {}


def _inplace_index(target: object) -> int | None:
    """Position of the ``inplace`` parameter of ``target`` (``F.relu(x, inplace)``), if any."""
    try:
        return _INPLACE_INDEX[target]
    except KeyError:
        pass
    except TypeError:  # unhashable target
        return None
    try:
        params = list(inspect.signature(target).parameters)  # type: ignore[arg-type]
        index = params.index("inplace") if "inplace" in params else None
    except (TypeError, ValueError):
        index = None
    _INPLACE_INDEX[target] = index
    return index


def writes_in_place(node: Node) -> bool:
    """Writes into one of its inputs (``add_``, ``x += y``, ``x[i] = y``, ``out=``,
    ``torch.relu_(x)``, ``F.relu(x, inplace=True)``)."""
    if "out" in node.kwargs or node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        target = str(node.target)
        return target.endswith("_") and not target.startswith("__")
    if node.op == "call_function":
        try:
            if node.target in _INPLACE_FUNCTIONS:
                return True
        except TypeError:
            pass
        name = str(getattr(node.target, "__name__", "")).split(".")[0]  # aten "add_.Tensor"
        if name.endswith("_") and not name.startswith("__"):  # torch.relu_, Tensor.add_
            return True
        index = _inplace_index(node.target)
        return index is not None and len(node.args) > index and node.args[index] is True
    return node.op == "call_module"  # unknown code: may write anywhere


def written_between(start: Node, end: Node | None = None) -> bool:
    """Some node after ``start`` and before ``end`` (the graph's output when None) writes in place."""
    n = start.next
    while n is not end and n.op not in ("output", "root"):
        if writes_in_place(n):
            return True
        n = n.next
    return False
