"""The rule layer's matcher: a pattern graph against a captured graph, rooted at one node.

What the matcher absorbs, so patterns stay one line (``torch.fx.subgraph_rewriter`` and
Inductor's ``pattern_matcher`` match by position only):

- spellings of one op: method, function, operator, in-place (``x /= c`` is
  ``operator.itruediv``; accepted only when nothing else reads the written tensor), aten
  overloads (``aten.mul.Tensor``), ``x**2`` / ``pow(x, 2)`` / ``square(x)`` / ``x*x``;
  a division by a constant is a product with its reciprocal (``x / sqrt(2)`` = ``x * 0.7071``);
- ``mul`` and ``add`` are associative and commutative: a chain of them is matched as a multiset
  (``0.5 * x * t`` = ``x * 0.5 * t`` = ``0.5 * (x * t)``);
- optional links between pattern nodes: no-op casts, up-casts (fp16/bf16 -> fp32), ``contiguous``,
  ``clone``, dropout with ``p = 0`` or not training, views and reshapes that keep the shape
  (a view that changes the shape is a link only where the pattern's algebra is elementwise
  across it, which the matcher cannot know: such views are written in the pattern);
- constants with a relative tolerance (1e-6), given as Python numbers, 0-d tensors
  (``torch.full((), c)``, ``torch.tensor(c)``) or host scalars computed from shapes;
- ``dim`` arguments modulo the input's rank, missing arguments as their defaults;
- no outside users: every node of the match but the root is read only inside the match
  (optional links may have other readers; they are left in place).

A match binds each wildcard to one value; a wildcard seen twice must see the same value, up to
optional links (T5 squares ``x.to(float32)`` and scales ``x``: both are ``x``).
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.fx import Node

from rewriter.capture.ir import arg, op_name, static_number, static_tensor, tensor_info

REL_TOL = 1e-6  # constants: transformers writes sqrt(2/pi) as 0.7978845608, BLOOM as 0.79788456

# Spellings op_name does not know: in-place operators and methods, erf/square, aten names.
_EXTRA_FUNCTIONS: dict[Any, str] = {
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
    operator.ipow: "pow", torch.erf: "erf", torch.special.erf: "erf", torch.square: "square",
    torch.exp: "exp", torch.special.expit: "sigmoid", torch.nn.functional.dropout: "dropout",
}
_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow}
_ATEN_NAMES = {"true_divide": "div", "_safe_softmax": "softmax", "_softmax": "softmax",
               "addmm": "addmm", "view": "view", "_unsafe_view": "view"}

# Argument names by position, and the defaults a missing argument takes (call_method nodes
# put ``self`` first, so one table serves functions, methods, operators and aten).
_SIGNATURES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "add": (("input", "other", "alpha"), {"alpha": 1}),
    "sub": (("input", "other", "alpha"), {"alpha": 1}),
    "mul": (("input", "other"), {}),
    "div": (("input", "other", "rounding_mode"), {"rounding_mode": None}),
    "pow": (("input", "exponent"), {}),
    "mean": (("input", "dim", "keepdim", "dtype"), {"keepdim": False, "dtype": None}),
    "rsqrt": (("input",), {}), "sqrt": (("input",), {}), "tanh": (("input",), {}),
    "erf": (("input",), {}), "sigmoid": (("input",), {}), "exp": (("input",), {}),
    "neg": (("input",), {}), "square": (("input",), {}),
    "silu": (("input", "inplace"), {"inplace": False}),
    "gelu": (("input", "approximate"), {"approximate": "none"}),
    "linear": (("input", "weight", "bias"), {"bias": None}),
    "chunk": (("input", "chunks", "dim"), {"dim": 0}),
    "split": (("input", "split_size_or_sections", "dim"), {"dim": 0}),
    "getitem": (("input", "index"), {}),
    "cat": (("tensors", "dim"), {"dim": 0}),
    "matmul": (("input", "other"), {}),
    "addmm": (("input", "mat1", "mat2", "beta", "alpha"), {"beta": 1, "alpha": 1}),
    "one_hot": (("input", "num_classes"), {"num_classes": -1}),
    "embedding": (("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
                  {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False,
                   "sparse": False}),
    "conv": (("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
             {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}),
    "batch_norm": (("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
                   {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}),
    "transpose": (("input", "dim0", "dim1"), {}),
    "to": (("input", "dtype"), {}),
    "var": (("input", "dim", "unbiased", "keepdim", "correction"), {"unbiased": None, "keepdim": False,
                                                                   "correction": None}),
}


def _var_correction(args: dict[str, Any]) -> dict[str, Any]:
    # var(unbiased=False) is var(correction=0); unbiased=True (or neither) is correction=1
    corr = args.pop("correction")
    unbiased = args.pop("unbiased")
    args["correction"] = corr if corr is not None else (0 if unbiased is False else 1)
    return args


_CANONICAL_ARGS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"var": _var_correction}
_DIM_ARGS = {"dim"}
_AC_OPS = ("mul", "add")  # associative and commutative: matched as multisets


def canonical(node: Any) -> str | None:
    """The op ``node`` computes, one name for all its spellings (``None`` when unknown)."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function":
        try:
            extra = _EXTRA_FUNCTIONS.get(node.target)
        except TypeError:
            extra = None
        if extra is not None:
            return extra
        if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            base = node.target.__name__.split(".")[0].rstrip("_") if not node.target.__name__.startswith("_") \
                else node.target.__name__.split(".")[0]
            return _ATEN_NAMES.get(base, base)
    if node.op == "call_method":
        target = str(node.target)
        if target in ("div_", "truediv", "true_divide", "true_divide_"):
            return "div"
        if target.endswith("_") and not target.startswith("_") and target[:-1] in _SIGNATURES:
            return target[:-1]  # in-place method (x.mul_(y)): see _writes_only_dead
        if target in _CAST_METHODS or target in ("type", "type_as"):
            return "to"  # every cast: compared by the dtype it produces
    return op_name(node)


def _writes_only_dead(node: Node) -> bool:
    """An in-place spelling is the pure op when nothing but it reads the tensor it writes."""
    inplace = (node.op == "call_method" and str(node.target).endswith("_")) or (
        node.op == "call_function" and (node.target in _INPLACE_FUNCTIONS
                                        or str(getattr(node.target, "__name__", "")).split(".")[0].endswith("_")))
    if not inplace:
        return True
    written = node.args[0] if node.args else None
    return not isinstance(written, Node) or all(u is node for u in written.users)


def number(value: Any) -> float | None:
    """A static number: a Python number, a 0-d constant tensor node, or a host scalar."""
    found = static_number(value)
    if found is not None:
        return found
    if isinstance(value, Node):
        if "host_scalar" in value.meta:
            return float(value.meta["host_scalar"])
        t = static_tensor(value)
        if t is not None and t.numel() == 1 and not t.requires_grad:
            return float(t.item())
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return None


def close(a: float | None, b: float) -> bool:
    """``a`` is the constant ``b`` to the rules' relative tolerance."""
    return a is not None and math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12)


# --- optional links ------------------------------------------------------------------------

def is_optional_link(node: Any) -> bool:
    """A node a pattern may look through: it changes no value the pattern computes with."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return False
    name = canonical(node)
    if name in ("contiguous", "clone"):
        return True
    if name == "dropout":
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
        return p == 0 or training is False
    a, b = tensor_info(node), tensor_info(node.args[0])
    if a is None or b is None:
        return False
    if name == "to":
        # no-op, or an up-cast between float dtypes (exact: every value is representable)
        return a.dtype == b.dtype or (a.dtype.is_floating_point and b.dtype.is_floating_point
                                      and a.dtype.itemsize > b.dtype.itemsize)
    if name in ("view", "reshape", "expand", "expand_as", "view_as"):
        return a.shape == b.shape
    return False


def _same_dtype(node: Node) -> bool:
    a, b = tensor_info(node), tensor_info(node.args[0])
    return a is not None and b is not None and a.dtype == b.dtype


def strip_links(value: Any) -> Any:
    """``value`` with the optional links it was read through taken off."""
    while is_optional_link(value):
        value = value.args[0]
    return value


# --- patterns ------------------------------------------------------------------------------

@dataclass
class _State:
    bound: dict[str, Any] = field(default_factory=dict)       # wildcard -> value
    seen: dict[Node, Node] = field(default_factory=dict)       # pattern node -> graph node
    nodes: list[Node] = field(default_factory=list)            # graph nodes of the match
    links: list[Node] = field(default_factory=list)            # optional links looked through

    def copy(self) -> "_State":
        return _State(dict(self.bound), dict(self.seen), list(self.nodes), list(self.links))


class _Const:
    """A constant factor of a product: a reciprocal of a divisor."""

    def __init__(self, value: float) -> None:
        self.value = value


class Pattern:
    """A pattern function traced into a graph; ``match(node)`` yields every way it fits."""

    def __init__(self, fn: Callable) -> None:
        try:
            self.graph = torch.fx.symbolic_trace(fn).graph
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"pattern {getattr(fn, '__name__', fn)!r} cannot be traced: {e}") from e
        self.name = getattr(fn, "__name__", "pattern")
        outputs = [n for n in self.graph.nodes if n.op == "output"]
        root = outputs[0].args[0]
        if not isinstance(root, Node) or root.op == "placeholder":
            raise ValueError(f"pattern {self.name!r} must compute something from its inputs")
        self.root = root
        self.wildcards = [n.target for n in self.graph.nodes if n.op == "placeholder"]

    def match(self, node: Node) -> Iterator[_State]:
        """Every binding of this pattern with its root at ``node`` (no link skipped at the root)."""
        if not isinstance(node, Node) or not _compatible(canonical(self.root), node):
            return
        yield from _match_op(self.root, node, _State())


def _match(p: Any, t: Any, st: _State) -> Iterator[_State]:
    """Ways the pattern value ``p`` matches the graph value ``t``."""
    if isinstance(p, Node) and p.op == "placeholder":
        yield from _bind(p.target, t, st)
        return
    if isinstance(p, Node):
        if p in st.seen:  # a pattern node read twice must be one graph node
            if strip_links(st.seen[p]) is strip_links(t):
                yield _with_links(st, t, st.seen[p])
            return
        if _compatible(canonical(p), t):
            yield from _match_op(p, t, st)
        if is_optional_link(t):  # or look through the link
            s2 = st.copy()
            s2.links.append(t)
            yield from _match(p, t.args[0], s2)
        return
    yield from _match_literal(p, t, st)


def _with_links(st: _State, t: Any, first: Any) -> _State:
    s2 = st.copy()
    for v in (t, first):
        while is_optional_link(v) and v not in s2.links and v not in s2.nodes:
            s2.links.append(v)
            v = v.args[0]
    return s2


def _bind(name: str, t: Any, st: _State) -> Iterator[_State]:
    if name not in st.bound:
        s2 = st.copy()
        s2.bound[name] = t
        yield s2
        return
    have = st.bound[name]
    if have is t or (isinstance(t, Node) and isinstance(have, Node) and strip_links(have) is strip_links(t)):
        yield _with_links(st, t, have) if have is not t else st
    elif not isinstance(t, Node) and not isinstance(have, Node) and t == have:
        yield st


def _match_literal(p: Any, t: Any, st: _State) -> Iterator[_State]:
    if isinstance(p, (int, float)) and not isinstance(p, bool):
        if close(number(t.value if isinstance(t, _Const) else t), float(p)):
            yield st
        return
    if isinstance(p, (list, tuple)) and isinstance(t, (list, tuple)) and len(p) == len(t):
        states = [st]
        for pi, ti in zip(p, t):
            states = [s for s0 in states for s in _match(pi, ti, s0)]
        yield from states
        return
    if p == t:
        yield st


_VARIADIC = {"permute": "dims", "view": "shape", "reshape": "shape"}  # x.view(2, 3) = x.view((2, 3))
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "double": torch.float64,
                 "bfloat16": torch.bfloat16}


def _normalise_cast(node: Node) -> dict[str, Any] | None:
    """A cast read as (input, dtype): from the node's recorded dtype in a captured graph, from
    its spelling in a pattern (``x.to(dtype)``, ``x.float()``)."""
    info = tensor_info(node)
    if info is not None:
        return {"input": node.args[0], "dtype": info.dtype}
    if node.target in _CAST_METHODS:
        return {"input": node.args[0], "dtype": _CAST_METHODS[node.target]}
    dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    return {"input": node.args[0], "dtype": dtype}


def _normalise(node: Node, name: str) -> dict[str, Any] | None:
    """``node``'s arguments by name, defaults filled; None when it has arguments we do not know."""
    if name == "to":
        return _normalise_cast(node)
    if name in _VARIADIC:
        key = _VARIADIC[name]
        rest = node.args[1:]
        value = tuple(rest) if len(rest) != 1 else rest[0]
        if not rest:
            value = node.kwargs.get(key, node.kwargs.get("size"))
        return {"input": node.args[0] if node.args else node.kwargs.get("input"),
                key: tuple(value) if isinstance(value, list) else value}
    sig = _SIGNATURES.get(name)
    if sig is None:
        return {**{str(i): a for i, a in enumerate(node.args)}, **node.kwargs}
    names, defaults = sig
    if len(node.args) > len(names):
        return None
    out = dict(defaults)
    out.update(zip(names, node.args))
    for k, v in node.kwargs.items():
        key = "input" if k == "self" else k
        if key not in names:
            return None
        out[key] = v
    fix = _CANONICAL_ARGS.get(name)
    return fix(out) if fix is not None else out


def _dims(value: Any, ndim: int | None) -> Any:
    if ndim is None:
        return value
    if isinstance(value, int):
        return (value % ndim,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(sorted(v % ndim for v in value))
    return value


def _compatible(name: str | None, t: Any) -> bool:
    """The graph node ``t`` may be a spelling of the pattern op ``name``."""
    have = canonical(t)
    return name is not None and (have == name or (name == "pow" and have in ("mul", "square"))
                                 or (name == "mul" and have == "div"))


def _match_op(p: Node, t: Node, st: _State) -> Iterator[_State]:
    name = canonical(p)
    if not _writes_only_dead(t):
        return
    if name == "pow" and canonical(t) in ("mul", "square"):
        yield from _match_square(p, t, st)
        return
    s0 = st.copy()
    s0.seen[p] = t
    s0.nodes.append(t)
    if name in _AC_OPS:
        ta = _normalise(t, canonical(t))
        if ta is not None and ta.get("alpha", 1) == 1 and ta.get("rounding_mode") is None:
            yield from _match_ac(p, t, name, s0)
        return
    pa, ta = _normalise(p, name), _normalise(t, name)
    if pa is None or ta is None or set(pa) != set(ta):
        return
    ndim = None
    src = ta.get("input")
    if isinstance(src, Node) and tensor_info(src) is not None:
        ndim = tensor_info(src).ndim
    states = [s0]
    for key in pa:
        pv, tv = pa[key], ta[key]
        if key in _DIM_ARGS and not isinstance(pv, Node):
            if _dims(pv, ndim) != _dims(tv, ndim):
                return
            continue
        states = [s for s1 in states for s in _match(pv, tv, s1)]
        if not states:
            return
    yield from states


def _match_square(p: Node, t: Node, st: _State) -> Iterator[_State]:
    """``pow(x, 2)`` in a pattern matches ``x * x`` and ``square(x)``."""
    pa = _normalise(p, "pow")
    if pa is None or isinstance(pa["exponent"], Node) or not close(float(pa["exponent"]), 2.0):
        return
    if canonical(t) == "square":
        operand = t.args[0]
    elif len(t.args) == 2 and not t.kwargs and strip_links(t.args[0]) is strip_links(t.args[1]):
        operand = t.args[0]
    else:
        return
    if not _writes_only_dead(t):
        return
    s0 = st.copy()
    s0.seen[p] = t
    s0.nodes.append(t)
    yield from _match(pa["input"], operand, s0)


def _pattern_terms(p: Node, name: str) -> list[Any]:
    """The operands of a pattern chain of ``name`` (mul/add), flattened."""
    out = []
    for a in (_normalise(p, name)["input"], _normalise(p, name)["other"]):
        if isinstance(a, Node) and a.op != "placeholder" and canonical(a) == name:
            out += _pattern_terms(a, name)
        else:
            out.append(a)
    return out


def _graph_splits(t: Node, name: str, top: bool = True) -> Iterator[tuple[list[Any], list[Node]]]:
    """Every way to read the graph chain at ``t`` as operands: (operands, chain nodes)."""
    args = _normalise(t, canonical(t))
    a, b = args["input"], args["other"]
    if name == "mul" and canonical(t) == "div":  # x / c is x * (1/c)
        c = number(b)
        if c is None or c == 0:
            return
        b = _Const(1.0 / c)
    options = []
    for x in (a, b):
        opts: list[tuple[list[Any], list[Node]]] = [([x], [])]
        inner, links = x, []
        while is_optional_link(inner) and len(inner.users) == 1 and _same_dtype(inner):  # w * norm.to(its dtype)
            links.append(inner)
            inner = inner.args[0]
        if isinstance(inner, Node) and len(inner.users) == 1 and _writes_only_dead(inner) and (
                canonical(inner) == name or (name == "mul" and canonical(inner) == "div")) and _plain(inner):
            opts += [(terms, nodes + links) for terms, nodes in _graph_splits(inner, name, top=False)]
        options.append(opts)
    for (ta, na), (tb, nb) in itertools.product(*options):
        yield ta + tb, na + nb + ([] if top else [t])


def _plain(t: Node) -> bool:
    """An add/mul/div without ``alpha`` or ``rounding_mode``: a term of a chain."""
    args = _normalise(t, canonical(t))
    return args is not None and args.get("alpha", 1) == 1 and args.get("rounding_mode") is None


def _match_ac(p: Node, t: Node, name: str, st: _State) -> Iterator[_State]:
    terms = _pattern_terms(p, name)
    for operands, chain in _graph_splits(t, name):
        if len(operands) != len(terms) or len(terms) > 6:
            continue
        base = st.copy()
        base.nodes += chain
        for perm in itertools.permutations(operands):
            states = [base]
            for pt, gt in zip(terms, perm):
                states = [s for s0 in states for s in _match_term(pt, gt, s0)]
                if not states:
                    break
            yield from states


def _match_term(p: Any, t: Any, st: _State) -> Iterator[_State]:
    if isinstance(t, _Const):
        if isinstance(p, (int, float)) and close(t.value, float(p)):
            yield st
        return
    yield from _match(p, t, st)
