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

The matcher and the spellings it absorbs: :mod:`rewriter.rule_matcher`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch.fx import Graph, GraphModule, Node

from rewriter.capture.ir import replace_node, tensor_info, writes_in_place
from rewriter.pass_api import Pass, PassContext, Site
from rewriter.rule_matcher import Pattern, canonical, close, is_optional_link, number, strip_links

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
        # a wildcard bound to an earlier site's root (linear(linear(x))) reads its replacement
        replaced: dict[Node, Node] = {}
        for site in sites:
            m: Match = site.match
            if any(isinstance(v, Node) and v in replaced for v in m.values.values()):
                m = dataclasses.replace(m, values={k: replaced.get(v, v) if isinstance(v, Node) else v
                                                   for k, v in m.values.items()})
            with g.inserting_before(m.root):
                new = m.rule.replacement(g, m, ctx)
            # wildcards bound to pure nodes only the match read (w.t(), x[..., :h]) go too
            bound = [v for v in m.values.values() if isinstance(v, Node)
                     and v.op in ("call_function", "call_method") and not writes_in_place(v)]
            replace_node(m.root, new, self.name, m.dead + bound)
            replaced[m.root] = new

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


def linear_in_out(m: Match, weight: str = "w") -> tuple[int, int] | None:
    """(in, out) features of a match's linear: the ``weight`` wildcard 2-D (``"w"`` laid out
    (out, in), as F.linear takes it; ``"v"`` (in, out), as a matmul does), ``x`` of its input
    width, ``b`` (when the rule binds one) 1-D of its outputs; None when the shapes do not fit."""
    xi, wi = m.info("x"), m.info(weight)
    if xi is None or wi is None or wi.ndim != 2 or xi.ndim < 1:
        return None
    n_in, n_out = (wi.shape[1], wi.shape[0]) if weight == "w" else (wi.shape[0], wi.shape[1])
    if xi.shape[-1] != n_in:
        return None
    if "b" in m.values:
        b = m.info("b")
        if b is None or tuple(b.shape) != (n_out,):
            return None
    return n_in, n_out


def computed_dtype(m: Match) -> torch.dtype | None:
    """The dtype the matched expression computes in: its root's."""
    info = tensor_info(m.root)
    return info.dtype if info is not None else None


__all__ = ["AUTOGRAD_FUNCTION", "Match", "Pattern", "Rule", "RulePass", "canonical", "cast_to", "close",
           "computed_dtype", "is_optional_link", "linear_in_out", "match_rules", "number", "strip_links"]
