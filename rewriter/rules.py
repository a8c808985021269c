"""Rewrites as rules: a pattern written as a plain function, a replacement, and safety checks.

A rule's pattern is an ordinary Python function; its parameters are wildcards (a tensor, a
scalar such as ``eps``, or ``None``) and its literals are constants to match. It is traced once
with ``torch.fx.symbolic_trace`` into a pattern graph, then matched against a captured graph
rooted at each node::

    def rms_norm_pattern(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    RULE = Rule("rms_norm", rms_norm_pattern,
                replacement=lambda g, m, ctx: ctx.backend.emit_rms_norm(g, m["x"], None, m.number("eps"), ...),
                checks=(can_take_eps,))       # each: (match, ctx) -> None, or the reason it declines

    class FuseRmsNorm(RulePass):              # one generic pass owns find/apply and the sites
        name, rules = "fuse_rms_norm", (RULE,)

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
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch.fx import Graph, GraphModule, Node

from rewriter.capture.ir import (
    arg,
    op_name,
    replace_node,
    static_number,
    static_tensor,
    tensor_info,
    writes_in_place,
)
from rewriter.pass_api import Pass, PassContext, Site

log = logging.getLogger(__name__)

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


# --- rules and matches ---------------------------------------------------------------------

@dataclass
class Match:
    """One fit of a rule: the root node, the wildcards' values, the nodes it covers."""

    rule: "Rule"
    root: Node
    values: dict[str, Any]
    nodes: list[Node]           # the graph nodes of the match, root first
    links: list[Node]           # optional links looked through (kept where others read them)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def number(self, name: str) -> float | None:
        return number(self.values.get(name))

    def info(self, name: str):
        return tensor_info(self.values.get(name))

    def node(self, op: str) -> Node | None:
        """The first node of the match computing ``op`` (for its dtype or shape)."""
        return next((n for n in self.nodes if canonical(n) == op), None)

    @property
    def dead(self) -> list[Node]:
        """What the rewrite leaves unread (erased when nothing else reads it)."""
        return [n for n in self.nodes[1:] + self.links]


Check = Callable[[Match, PassContext], "str | None"]
Replacement = Callable[[Graph, Match, PassContext], Node]


@dataclass(frozen=True)
class Rule:
    """A pattern, its replacement and the safety checks that decide whether it may apply.

    ``requires``: structural conditions (a weight of the normalised size); a match failing one
    is not this rule's site at all. ``checks`` (``can_*``): a match failing one is a site the
    pass declines, with the reason returned (``ctx.decline``). ``describe`` names the site.
    """

    name: str
    pattern: Callable
    replacement: Replacement
    requires: tuple[Callable[[Match], bool], ...] = ()
    checks: tuple[Check, ...] = ()
    describe: Callable[[Match], str] | None = None
    _compiled: list = field(default_factory=list, compare=False, repr=False)

    @property
    def compiled(self) -> Pattern:
        if not self._compiled:
            self._compiled.append(Pattern(self.pattern))
        return self._compiled[0]

    def match(self, node: Node) -> Match | None:
        """The first fit of this rule at ``node`` that meets its ``requires``, else None."""
        for st in self.compiled.match(node):
            m = Match(self, node, dict(st.bound), _unique(st.nodes), _unique(st.links))
            if _self_contained(m) and all(req(m) for req in self.requires):
                return m
        return None


def _unique(nodes: list[Node]) -> list[Node]:
    return list(dict.fromkeys(nodes))


def _self_contained(m: Match) -> bool:
    """No outside users: every node but the root is read only by nodes of the match."""
    inside = set(m.nodes) | set(m.links)
    bound = {v for v in m.values.values() if isinstance(v, Node)}
    for n in m.nodes[1:]:
        if n in bound or any(u not in inside for u in n.users):
            return False
    return True


def match_rules(rules: tuple[Rule, ...], node: Node) -> Match | None:
    """The first rule of ``rules`` that fits at ``node`` (rules are tried in table order)."""
    for rule in rules:
        m = rule.match(node)
        if m is not None:
            return m
    return None


AUTOGRAD_FUNCTION = "inside an autograd.Function: its backward is the user's own, so it is not rewritten"


class RulePass(Pass):
    """A pass that is a table of rules: the one find/apply driver.

    Nodes are visited from the graph's end, so the widest rule claims its nodes before a rule
    of a sub-expression can (``w * norm(x)`` before ``norm(x)``); a node claimed once is not
    matched again. A site's anchor is the match's root, the node the replacement stands for.
    Sub-graphs of Dynamo's ``autograd_function_apply`` are searched too, and their matches
    reported as declined ("inside an autograd.Function").
    """

    rules: ClassVar[tuple[Rule, ...]] = ()

    def cannot_find(self, ctx: PassContext) -> str | None:
        """Why this pass finds nothing at all in ``ctx`` (checked once per graph); None: look."""
        return None

    def active_rules(self, ctx: PassContext) -> tuple[Rule, ...]:
        """The rules tried in ``ctx`` (a subclass may leave some out: an opt-in approximation)."""
        return self.rules

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        if self.cannot_find(ctx) is not None:
            return []
        rules = self.active_rules(ctx)
        sites, claimed = [], set()
        for node in reversed(list(gm.graph.nodes)):
            if node in claimed or node.op not in ("call_function", "call_method"):
                continue
            m = match_rules(rules, node)
            if m is None or any(n in claimed for n in m.nodes):
                continue
            claimed.update(m.nodes)  # a declined site is still this rule's: no sub-rule takes part of it
            why = next((w for w in (c(m, ctx) for c in m.rule.checks) if w), None)
            if why is not None:
                ctx.decline(f"{self.name} at {node.name}", why)
                continue
            label = m.rule.describe(m) if m.rule.describe else m.rule.name
            sites.append(Site(node, f"{node.name}: {label}", m))
        self._report_autograd_functions(gm, ctx, rules)
        return list(reversed(sites))

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites:
            m: Match = site.match
            with g.inserting_before(m.root):
                new = m.rule.replacement(g, m, ctx)
            # wildcards bound to pure nodes only the match read (w.t(), x[..., :h]) go too
            bound = [v for v in m.values.values() if isinstance(v, Node)
                     and v.op in ("call_function", "call_method") and not writes_in_place(v)]
            replace_node(m.root, new, self.name, m.dead + bound)

    def _report_autograd_functions(self, gm: GraphModule, ctx: PassContext, rules: tuple[Rule, ...]) -> None:
        for node in gm.graph.nodes:
            if "autograd_function_apply" not in str(getattr(node, "target", "")):
                continue
            for sub in node.args:
                if not (isinstance(sub, Node) and sub.op == "get_attr"):
                    continue
                body = getattr(gm, str(sub.target), None)
                if not isinstance(body, GraphModule):
                    continue
                for inner in body.graph.nodes:
                    if inner.op in ("call_function", "call_method") and match_rules(rules, inner):
                        ctx.decline(f"{self.name} at {node.name}/{sub.target}.{inner.name}", AUTOGRAD_FUNCTION)


# --- small helpers the rule tables share ------------------------------------------------------

def cast_to(g: Graph, value: Node, dtype: torch.dtype | None) -> Node:
    """``value`` in ``dtype`` (a new ``.to`` node), or ``value`` itself when it already is."""
    info = tensor_info(value)
    if dtype is None or info is None or info.dtype == dtype:
        return value
    return g.call_method("to", (value, dtype))


def computed_dtype(m: Match) -> torch.dtype | None:
    """The dtype the matched expression computes in: its root's."""
    info = tensor_info(m.root)
    return info.dtype if info is not None else None


__all__ = ["AUTOGRAD_FUNCTION", "Match", "Pattern", "Rule", "RulePass", "canonical", "cast_to", "close",
           "computed_dtype", "is_optional_link", "match_rules", "number", "strip_links"]
