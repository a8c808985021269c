"""What a rewrite pass is, and the registry that names them.

A pass finds sites in one captured graph and rewrites them; it never measures (the gate does)::

    class FuseThing(Pass):
        name = "fuse_thing"
        contract = "exact"                      # or "reduced": only with optimize(dtype=...)
        devices = frozenset({"cpu", "cuda", "npu"})
        scope = "site"                          # or "step": no local region to measure

        def find(self, gm, ctx):                # cheap safety checks only
            return [Site(node, "thing at " + node.name) for node in ... if can_fuse(node)]

        def apply(self, gm, sites, ctx):        # mutate gm.graph; ctx.backend emits the fused op
            ...

    register_pass(FuseThing())
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch.fx import GraphModule

if TYPE_CHECKING:
    from rewriter.devices.backends import Backend

log = logging.getLogger(__name__)

Contract = Literal["exact", "reduced"]


@dataclass
class Site:
    """One place in a graph where a pass applies. ``match`` is the pass's own record of it."""

    anchor: Any  # the fx Node the rewrite replaces (its output keeps the same users)
    description: str
    match: Any = None
    # Nodes the rewrite changes without renaming them or their arguments (a chain recomputed
    # in another dtype): their region includes them, though each computes "the same" call.
    covers: tuple = ()


@dataclass(frozen=True)
class PassContext:
    """What a pass may know about the job: the device backend, the mode, the dtype opt-in."""

    backend: "Backend"
    training: bool
    dtype: torch.dtype | None = None
    region: bool = False  # finding in a standalone region graph (its inputs may be half already)
    objective: str = "time"  # optimize(objective=): "memory" lets a pass trade returned values
    # Why matched sites were declined (a device limit, a mask it cannot take), newest last:
    # ``decline()`` appends; whoever reports a pass that found no site reads and clears it.
    declined: list[str] = field(default_factory=list, compare=False, repr=False)

    def decline(self, where: str, reason: str) -> None:
        """Record that the site at ``where`` matched but is declined, and why."""
        log.info("rewriter: %s declined: %s", where, reason)
        self.declined.append(f"{where}: {reason}")


class Pass:
    """Base class of rewrite passes; subclasses set the class attributes and two methods."""

    name: ClassVar[str] = ""
    contract: ClassVar[Contract] = "exact"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda", "npu"})
    version: ClassVar[int] = 1
    # "site": each site's region is measured on its own (rewriter.capture.region); "step": the rewrite
    # has no local region (precision of a whole graph, layouts across a network, long dtype
    # chains) and is measured on the whole step.
    scope: ClassVar[str] = "site"
    # Decides the precision everything else runs in: tried first, then applied on top of every
    # variant measured after it (rewriter.pipeline), so fusions are measured in that dtype.
    sets_precision: ClassVar[bool] = False
    # The fused replacement this pass asks the backend for ("rms_norm", "attention", ...), if
    # any: where the backend cannot emit it here (chip, torch_npu version), the pass does not apply.
    fused_kind: ClassVar[str | None] = None
    # May set an output the caller could read to None (fuse_linear_cross_entropy: the returned
    # logits), only under objective="memory"; verification then skips outputs that became None.
    drops_outputs: ClassVar[bool] = False
    # The most of its regions' time this pass can save, as a share: the passes are measured
    # hottest first (rewriter.decide.hot_first) by their regions' time times this. 1: the
    # region can vanish; reuse_linear_output keeps its GEMM and saves only the fresh pages.
    saves_at_most: ClassVar[float] = 1.0
    # Rewrites fp32 ops only (onednn_linear: fp32 GEMMs): not tried while a kept or speculated
    # precision pass runs the graphs in half, where it would only be measured doing nothing.
    full_precision_only: ClassVar[bool] = False
    # Saves only the host pages a step maps afresh (reuse_linear_output: a kept buffer, the same
    # GEMM): not tried where the user's step maps few (rewriter.decide.fresh_heap), where its
    # regions would only be measured saving nothing.
    saves_fresh_pages_only: ClassVar[bool] = False
    # Its replacement's backward runs the original's ops (reuse_linear_output: F.linear's
    # GEMMs): in training its regions are timed forward only, the part it changes (the
    # backward would add the same time to both sides, and its noise; an LM head's is two of
    # its three GEMMs). They are verified forward and backward all the same.
    same_backward: ClassVar[bool] = False

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        raise NotImplementedError(f"{type(self).__name__}.find")

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def applies_to(self, ctx: PassContext) -> str | None:
        """None when this pass may run in ``ctx``, else the reason it may not."""
        if ctx.backend.name not in self.devices:
            return f"serves {', '.join(sorted(self.devices))}, not {ctx.backend.name}"
        if self.contract == "reduced" and ctx.dtype is None:
            return "lowers precision; enabled only with optimize(dtype=...)"
        if self.fused_kind is not None:
            return ctx.backend.cannot_offer(self.fused_kind, training=ctx.training)
        return None

    def __repr__(self) -> str:
        return f"<pass {self.name} v{self.version} ({self.contract})>"


_REGISTRY: dict[str, Pass] = {}


def register_pass(p: Pass) -> Pass:
    """Add ``p`` to the passes ``optimize()`` runs by default, in registration order."""
    if not isinstance(p, Pass) or not p.name:
        raise TypeError(f"register_pass expects a Pass instance with a name, got {p!r}")
    _REGISTRY[p.name] = p
    return p


def registered_passes() -> dict[str, Pass]:
    """Name -> pass, in the fixed order optimize() tries them."""
    import passes  # noqa: F401  (registers the built-in passes on first use)
    return dict(_REGISTRY)


def resolve_passes(selection: Any, exclude: str | tuple[str, ...] | list[str] = ()) -> list[Pass]:
    """Turn ``optimize(passes=..., exclude=...)`` into pass objects, naming any unknown name."""
    known = registered_passes()
    if isinstance(exclude, str):
        exclude = (exclude,)
    for name in exclude:
        if name not in known:
            raise ValueError(f"exclude names unknown pass {name!r}; known passes: {sorted(known)}")
    if selection is None:
        chosen = list(known.values())
    else:
        if isinstance(selection, (str, Pass)):
            selection = [selection]
        chosen = []
        for item in selection:
            if isinstance(item, Pass):
                chosen.append(item)
            elif isinstance(item, str):
                if item not in known:
                    raise ValueError(f"unknown pass {item!r}; known passes: {sorted(known)}")
                chosen.append(known[item])
            else:
                raise TypeError(f"passes must be names or Pass objects, got {type(item).__name__}")
    return [p for p in chosen if p.name not in set(exclude)]
