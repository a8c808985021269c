"""Site regions: the part of a graph one rewrite replaces, as two standalone graphs.

A pass rewrites a graph; the region of a site is what changed, found by comparing the graph
before (``kept``) and after (``candidate``) node by node (fx keeps node names through a graph
copy, and passes add nodes under new names)::

    regions = find_regions(kept, candidate, sites)   # a list of Region, or a reason string
    r = regions[0]
    r.before(*values)      # the original nodes, fed the boundary values, returning the outputs
    r.after(*values)       # the replacement, same inputs, same outputs (as a tuple)

Interior nodes are those only one graph has, or that both have under one name but that compute
something else. A value leaves the region where a node both graphs share reads a different
node in the candidate than in the kept graph (so a rewrite that inserts a node between two
shared ones has a region whose ``before`` is the identity). Connected interior nodes form one
region; sites whose anchors fall into one region are decided together.

The signature of a region (pass, both graphs' structure, boundary shapes, dtypes, strides) is
what decides whether two sites are "the same": measured once, stored in the knowledge base.
A site may name the nodes it ``covers``: ones the rewrite changes without a new name (an int64
chain recomputed in int32 reads the same calls, yet every value in it changes dtype).
A pass whose change is not local (nodes that write in place, changes no site accounts for)
gets a reason instead of regions, and the gate measures it on the whole step; where only the
latter holds, ``require_sites=False`` still cuts out what it changes (for the order passes are
measured in, rewriter.decide.hot_first).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate

from rewriter.capture.ir import lazy_graph_module, tensor_info, writes_in_place
from rewriter.pass_api import Site

_NODE = object()  # stands for a node argument when comparing what two nodes compute


@dataclass
class Region:
    """One rewritten place: both forms as standalone GraphModules over the same inputs."""

    pass_name: str
    slot: str
    sites: list[str]            # descriptions of the sites it holds
    anchors: list[str]          # names of those sites' anchor nodes in the kept graph
    inputs: list[str]           # boundary inputs: names of kept-graph nodes, in graph order
    outputs: list[str]          # kept-graph names of the values leaving the region
    before: GraphModule
    after: GraphModule
    structure: str = ""         # canonical text of both graphs (shape-free)
    boundary: list[str] = field(default_factory=list)  # per input: dtype/shape/stride, or value

    @property
    def label(self) -> str:
        return "; ".join(self.sites) if self.sites else f"near {self.outputs[0]}"

    def signature(self, device: str, mode: str, pass_version: int, precision: str | None = None) -> str:
        """What makes two regions one decision (a hash; :meth:`signature_text` is readable).
        ``precision``: the dtype a precision pass runs the graph in, when one is kept."""
        text = self.signature_text(device, mode, pass_version, precision)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def signature_text(self, device: str, mode: str, pass_version: int,
                       precision: str | None = None) -> str:
        return "\n".join([f"pass {self.pass_name} v{pass_version}", f"device {device}", f"mode {mode}",
                          f"precision {precision or 'as captured'}",
                          "inputs " + ", ".join(self.boundary), self.structure])

    @property
    def before_structure(self) -> str:
        """The canonical text of the original form alone (``structure``'s first part)."""
        return self.structure.partition("\nafter:\n")[0]

    @property
    def structure_key(self) -> str:
        """Shape-free identity (pass and structure): for graphs Dynamo compiles later."""
        return hashlib.sha256(f"{self.pass_name}\n{self.structure}".encode()).hexdigest()[:20]


def _computes(n: Node) -> Any:
    """What a node computes, with its node arguments blanked out (compared by position)."""
    try:
        shape = map_aggregate((n.args, n.kwargs), lambda a: _NODE if isinstance(a, Node) else a)
    except Exception:  # noqa: BLE001
        shape = repr((n.args, n.kwargs))
    return (n.op, n.target, shape)


def _same(a: Node, b: Node) -> bool:
    try:
        return bool(_computes(a) == _computes(b))
    except Exception:  # noqa: BLE001 (a tensor constant: ambiguous truth value)
        return False


def _node_args(n: Node) -> list[Any]:
    """All leaves of a node's args and kwargs, in a fixed order (nodes and constants alike)."""
    leaves: list[Any] = []
    map_aggregate((n.args, tuple(sorted(n.kwargs.items()))), lambda a: leaves.append(a) or a)
    return leaves


class _Union:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def add(self, k: str) -> None:
        self.parent.setdefault(k, k)

    def find(self, k: str) -> str:
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def join(self, a: str, b: str) -> None:
        self.add(a)
        self.add(b)
        self.parent[self.find(a)] = self.find(b)


def find_regions(kept: GraphModule, candidate: GraphModule, sites: list[Site], pass_name: str,
                 slot: str, require_sites: bool = True) -> list[Region] | str:
    """The regions ``candidate`` differs from ``kept`` in, or why they cannot be cut out.
    ``require_sites=False``: a change no site accounts for is a region too (with no sites):
    what a pass that is measured on the whole step reaches, to order it among the others."""
    k_nodes = {n.name: n for n in kept.graph.nodes}
    c_nodes = {n.name: n for n in candidate.graph.nodes}
    covered = {n.name if isinstance(n, Node) else n for s in sites for n in s.covers}
    shared = {name for name, n in k_nodes.items()
              if name in c_nodes and name not in covered and _same(n, c_nodes[name])}
    k_inner = [n for n in kept.graph.nodes if n.name not in shared]
    c_inner = [n for n in candidate.graph.nodes if n.name not in shared]
    for n in k_inner + c_inner:
        if writes_in_place(n) and n.op != "call_module":
            return f"{n.name} writes in place"

    def key(side: str, n: Node) -> str:
        return f"s:{n.name}" if n.name in shared else f"{side}:{n.name}"

    u = _Union()
    for side, inner in (("k", k_inner), ("c", c_inner)):
        for n in inner:
            u.add(f"{side}:{n.name}")
            for a in n.all_input_nodes:
                if a.name not in shared:
                    u.join(f"{side}:{n.name}", f"{side}:{a.name}")
    for n in k_inner:
        if n.name in c_nodes and n.name not in shared:
            u.join(f"k:{n.name}", f"c:{n.name}")  # one node, changed in place
    pairs: dict[str, Node] = {}  # kept-graph output name -> the candidate's node for it
    for name in shared:
        k_args, c_args = _node_args(k_nodes[name]), _node_args(c_nodes[name])
        for a, b in zip(k_args, c_args):
            if not isinstance(a, Node):
                continue
            if not isinstance(b, Node):
                return f"{name} reads a constant where it read {a.name}"
            if a.name == b.name and a.name in shared:
                continue
            if a.name in pairs and pairs[a.name].name != b.name:
                return f"{a.name} is replaced by two different values"
            pairs[a.name] = b
            u.join(key("k", a), key("c", b))
    if not pairs:
        return "the rewrite changed no value that the rest of the graph reads"

    groups: dict[str, dict[str, Any]] = {}
    for k in list(u.parent):
        g = groups.setdefault(u.find(k), {"keys": set(), "outputs": [], "sites": []})
        g["keys"].add(k)
    order = {n.name: i for i, n in enumerate(kept.graph.nodes)}
    for out_name in sorted(pairs, key=lambda n: order.get(n, 0)):
        groups[u.find(key("k", k_nodes[out_name]))]["outputs"].append(out_name)
    for site in sites:
        anchor = site.anchor.name if isinstance(site.anchor, Node) else None
        if anchor is None or anchor not in k_nodes:
            continue
        k = key("k", k_nodes[anchor])
        if k in u.parent:
            groups[u.find(k)]["sites"].append(site)
    regions = []
    for g in groups.values():
        if not g["outputs"]:
            continue  # dead nodes the rewrite erased, read by nothing
        if not g["sites"] and require_sites:
            return "it changes nodes that no site accounts for"
        regions.append(_region(kept, candidate, g, shared, pairs, order, pass_name, slot))
    if not regions:
        return "no region with outputs"
    return regions


def _region(kept: GraphModule, candidate: GraphModule, g: dict[str, Any], shared: set[str],
            pairs: dict[str, Node], order: dict[str, int], pass_name: str, slot: str) -> Region:
    keys = g["keys"]
    k_body = [n for n in kept.graph.nodes if f"k:{n.name}" in keys]
    c_body = [n for n in candidate.graph.nodes if f"c:{n.name}" in keys]
    inputs: set[str] = {k[2:] for k in keys if k.startswith("s:")}
    for n in k_body + c_body:
        inputs.update(a.name for a in n.all_input_nodes if a.name in shared)
    input_names = sorted(inputs, key=lambda n: order[n])
    outputs = g["outputs"]
    k_by_name = {n.name: n for n in kept.graph.nodes}
    before = _standalone(kept, k_body, input_names, [k_by_name[o] for o in outputs], k_by_name)
    after = _standalone(candidate, c_body, input_names, [pairs[o] for o in outputs], k_by_name)
    boundary = [_describe_input(k_by_name[n]) for n in input_names]
    structure = "before:\n" + _canonical(before) + "\nafter:\n" + _canonical(after)
    sites: list[Site] = g["sites"]
    return Region(pass_name, slot, [s.description for s in sites], [s.anchor.name for s in sites],
                  input_names, outputs, before, after, structure, boundary)


def _standalone(root: GraphModule, body: list[Node], inputs: list[str], outputs: list[Node],
                kept_nodes: dict[str, Node]) -> GraphModule:
    g = Graph()
    env: dict[str, Node] = {}
    for name in inputs:
        p = g.placeholder(name)
        p.meta.update(kept_nodes[name].meta)
        env[name] = p
    for n in body:
        env[n.name] = g.node_copy(n, lambda a: env[a.name])
    g.output(tuple(env[o.name] for o in outputs))
    return lazy_graph_module(root, g, "Region")


def _describe_input(n: Node) -> str:
    info = tensor_info(n)
    if info is not None:
        return f"{str(info.dtype).replace('torch.', '')}{list(info.shape)}s{list(info.stride)}" \
               + ("g" if info.requires_grad else "")
    if "host_scalar" in n.meta:
        return repr(n.meta["host_scalar"])
    value = n.meta.get("example_value")
    if isinstance(value, (int, float, bool)) or value is None:
        return repr(value) if "example_value" in n.meta else "?"
    return type(value).__name__


def _target_name(n: Node) -> str:
    if n.op in ("placeholder", "output"):
        return n.op
    if n.op == "get_attr":
        info = tensor_info(n)
        return f"attr {str(info.dtype).replace('torch.', '') if info else '?'}{list(info.shape) if info else ''}"
    if n.op == "call_module":
        return "module"
    t = n.target
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"


def _canonical(gm: GraphModule) -> str:
    """The graph's computation with node names replaced by positions (shape-free)."""
    index: dict[Node, int] = {}
    lines = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            lines.append(f"%{i} = input")
            continue

        def show(a: Any) -> Any:
            return f"%{index[a]}" if isinstance(a, Node) else a
        args = map_aggregate((n.args, n.kwargs), show)
        lines.append(f"%{i} = {n.op} {_target_name(n)} {args!r}")
    return "\n".join(lines)


def dtype_of_region(values: list[Any]) -> torch.dtype:
    """The precision a region runs in: the lowest floating dtype among its inputs."""
    return lowest_float_dtype(v.dtype for v in values if isinstance(v, torch.Tensor))


def captured_dtype(region_gm: GraphModule) -> torch.dtype:
    """:func:`dtype_of_region` from the captured facts of a region's inputs (no values)."""
    infos = (tensor_info(n) for n in region_gm.graph.nodes if n.op == "placeholder")
    return lowest_float_dtype(i.dtype for i in infos if i is not None)


def lowest_float_dtype(dtypes: Any) -> torch.dtype:
    found = {d for d in dtypes if d.is_floating_point}
    for d in (torch.float16, torch.bfloat16, torch.float32):
        if d in found:
            return d
    return torch.float32
