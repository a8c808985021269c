"""What was kept, as data, and how to build a graph from it.

A kept pass names the pass and which of its sites run: all of them (a pass measured on the
whole step), or those whose region signature was kept. Graphs compiled later (a new input shape, the other
train/eval mode) have regions of new signatures: those follow the pass unless a region of the
same shape-free structure was rejected and none kept::

    kp = KeptPass(pass_, signatures={"a1b2..."}, structures={"c3d4..."})
    gm2 = apply_kept(gm, kp, ctx)        # a new GraphModule, or None when nothing applies
    gm3 = build(slot.original, kept, ctx)  # every kept pass, in order
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import GraphModule

from rewriter.capture.front_ends import finish_rewrite
from rewriter.capture.ir import copy_graph_module
from rewriter.capture.region import Region, find_regions
from rewriter.pass_api import Pass, PassContext


@dataclass
class KeptPass:
    pass_: Pass
    signatures: set[str] | None = None  # None: every site (a step-level decision)
    structures: set[str] = field(default_factory=set)
    rejected_structures: set[str] = field(default_factory=set)  # and never kept
    rejected: set[str] = field(default_factory=set)  # signatures measured and not kept
    precision: str | None = None  # the precision its regions were measured in (signatures)

    @property
    def name(self) -> str:
        return self.pass_.name

    def wants(self, region: Region, ctx: PassContext) -> bool:
        if self.signatures is None:
            return True
        sig = region.signature(ctx.backend.name, mode_of(ctx), self.pass_.version, self.precision)
        if sig in self.signatures:
            return True
        if sig in self.rejected or region.structure_key in self.rejected_structures:
            return False
        return True  # a site never measured (new shapes, the other mode) follows its pass

    def to_dict(self) -> dict:
        return {"signatures": sorted(self.signatures) if self.signatures is not None else None,
                "structures": sorted(self.structures),
                "rejected_structures": sorted(self.rejected_structures),
                "rejected": sorted(self.rejected), "precision": self.precision}

    @classmethod
    def from_dict(cls, p: Pass, d: dict | None) -> "KeptPass":
        if not d:
            return cls(p)  # a plan from before site-level decisions: every site
        sigs = d.get("signatures")
        return cls(p, set(sigs) if sigs is not None else None, set(d.get("structures", ())),
                   set(d.get("rejected_structures", ())), set(d.get("rejected", ())),
                   d.get("precision"))


def mode_of(ctx: PassContext) -> str:
    return "training" if ctx.training else "inference"


def apply_sites(gm: GraphModule, p: Pass, ctx: PassContext, anchors: set[str] | None
                ) -> GraphModule | None:
    """A copy of ``gm`` with the sites of ``p`` whose anchors are named (all: None) rewritten."""
    new = copy_graph_module(gm)
    sites = p.find(new, ctx)
    if anchors is not None:
        sites = [s for s in sites if getattr(s.anchor, "name", None) in anchors]
    if not sites:
        return None
    p.apply(new, sites, ctx)
    finish_rewrite(new)
    return new


def apply_kept(gm: GraphModule, kp: KeptPass, ctx: PassContext, slot: str = "") -> GraphModule | None:
    """``gm`` with the kept sites of one pass rewritten (None when none of them is here)."""
    full = apply_sites(gm, kp.pass_, ctx, None)
    if full is None or kp.signatures is None:
        return full
    sites = kp.pass_.find(copy_graph_module(gm), ctx)
    regions = find_regions(gm, full, sites, kp.name, slot)
    if isinstance(regions, str):
        return None  # decided per site, but not separable here: leave it
    chosen = [r for r in regions if kp.wants(r, ctx)]
    if len(chosen) == len(regions):
        return full
    if not chosen:
        return None
    return apply_sites(gm, kp.pass_, ctx, {a for r in chosen for a in r.anchors})


def build(original: GraphModule, kept: list[KeptPass], ctx: PassContext, slot: str = "") -> GraphModule:
    """The original graph with every kept pass applied in order (precision passes excluded:
    they are the slot's overlay)."""
    gm = original
    for kp in kept:
        if kp.pass_.sets_precision:
            continue
        new = apply_kept(gm, kp, ctx, slot)
        if new is not None:
            gm = new
    return gm


def overlay_for(kept: list[KeptPass], ctx: PassContext):  # -> Callable | None
    """The precision pass among ``kept`` as a function graph -> graph, or None."""
    precision = [kp for kp in kept if kp.pass_.sets_precision]
    if not precision:
        return None

    def overlay(gm: GraphModule) -> GraphModule:
        for kp in precision:
            new = apply_sites(gm, kp.pass_, ctx, None)
            gm = new if new is not None else gm
        return gm
    return overlay
