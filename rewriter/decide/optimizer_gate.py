"""The fused optimizer, gated on its own step (it has no region in the graph).

The update runs on scratch copies of the parameters, gradients and state (the user's are not
touched): first 5 steps from the same state must give the same parameters as the original
optimizer (on each parameter's first rows, :data:`NUMERICS_MAX_NUMEL`), then the two steps are
timed side by side like any other candidate, on whole parameters. Both run on one
instance of each distinct repeated block and the parameters outside the blocks
(``rewriter.decide.param_sample``: the decision's cost and memory do not grow with depth); the
saving is scaled to the whole step::

    decision, chosen = gate_optimizer(job, clock, gate_settings, min_speedup, knowledge_base=kb)

Its timing is stored in the knowledge base under a signature of the step (optimizer class, the
flags that choose its kernels, the parameters' shapes and dtypes, device, versions), like a
region's: a second run of the same training job verifies the fused step again (cheap, and
never taken from the knowledge base) but does not time it again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Collection

from rewriter.decide.gate import Clock, GateSettings, Step, clearly_one_way, decide, known_verdict, measure, saved_ms
from rewriter.decide.job import Job
from rewriter.decide.knowledge import KnowledgeBase, entry_key
from rewriter.decide.param_sample import sample_parameters
from rewriter.decide.verify import Tolerance, compare_runs
from rewriter.devices import optimizers
from rewriter.report import Decision

# The bar for a fused optimizer: 5 steps whose updates (the parameters' change) are within 1e-4
# of the original's, element by element and of the tensor's largest update. On the update, not on
# the parameters: a fused kernel computes the step size in fp32 (Adam's 1 - 0.999**t rounds to a
# relative 1.3e-5 at t=1), so its update differs from the for-loop's by ~1e-5 of the update,
# whatever the parameter's size: XLM-R's head bias, zero at the start, was failed now and then at
# 1e-5 of the parameters (880 of 8000 elements, 3.2e-8 off values of 5e-4 after 5 steps of lr
# 1e-4), while a weight of 0.02 was allowed ~3e-7 (the new bar: 5e-8 for the same update). A
# wrong update (another learning rate, a missing term) is off by a share of the update itself.
OPTIMIZER_STEPS = 5
OPTIMIZER_TOLERANCE = Tolerance(rtol=1e-4, atol_scale=1e-4)
# Those 5 steps run on each parameter's first rows, 2**18 elements or more: an update is
# elementwise, and 2**18 spans several of the fused kernels' chunks (65 536 elements on CUDA).
# A 32 000 x 256 embedding and head took 1.5 s of a 12 s budget copied and stepped whole.
NUMERICS_MAX_NUMEL = 1 << 18


# How the optimizer's own step is timed, in its knowledge-base key: version 2 warms it up for a
# region's time (2 rounds), where version 1 warmed it up for a whole step's (up to 10 rounds).
# Figures timed another way are measured again, not replayed.
OPTIMIZER_TIMING = "2"

# Group options that choose how the update runs (its kernel and its work), unlike lr or betas.
_KERNEL_FLAGS = ("foreach", "fused", "amsgrad", "maximize", "capturable", "differentiable",
                 "decoupled_weight_decay", "nesterov", "centered", "momentum")


def step_signature(optimizer: Any, cand: optimizers.OptimizerCandidate, device: str) -> str:
    """What makes two optimizer steps one timing: readable text (hashed into a key)."""
    groups = []
    for g in optimizer.param_groups:
        flags = {k: g[k] for k in _KERNEL_FLAGS if k in g and isinstance(g[k], (bool, int, float, type(None)))}
        flags["weight_decay"] = bool(g.get("weight_decay"))
        shapes = [[list(p.shape), str(p.dtype)] for p in g["params"] if p.requires_grad]
        groups.append({"flags": flags, "params": hashlib.sha256(
            json.dumps(shapes).encode()).hexdigest()[:16], "count": len(shapes)})
    return json.dumps({"pass": "fuse_optimizer", "optimizer": type(optimizer).__name__,
                       "candidate": cand.description, "device": device, "groups": groups},
                      sort_keys=True)


def gate_optimizer(job: Job, clock: Clock, settings: GateSettings, min_speedup: float,
                   replace_allowed: bool = True, deadline: float | None = None,
                   knowledge_base: KnowledgeBase | None = None
                   ) -> tuple[Decision, optimizers.OptimizerCandidate | None]:
    """Try the fused forms of the job's optimizer; the first that passes wins. The kept
    decision's ``measurement["sample"]`` says what it was timed on and the scale to the step."""
    found, why_none = optimizers.candidates(job.optimizer, job.backend)
    if not replace_allowed:
        found = [c for c in found if c.flags is not None]
        why_none += "; optimize() without example inputs can only switch the optimizer in place"
    if not found:
        return Decision("fuse_optimizer", False, "not applicable", why_none, scope="step"), None
    tried = []
    sample = sample_parameters(job.optimizer, job.model)
    for cand in found:
        ok, detail, err = optimizer_numerics(job.optimizer, cand, sample.ids)
        if not ok:
            tried.append(f"{cand.description}: failed verification ({detail})")
            continue
        key = entry_key(step_signature(job.optimizer, cand, job.backend.name),
                        {**job.backend.knowledge_key(), "optimizer timing": OPTIMIZER_TIMING})
        known = knowledge_base.get(key) if knowledge_base is not None else None
        if known is not None:
            figures, speedup, noise = known, known["speedup"], known["noise"]
            keep, reason = known_verdict(known, min_speedup, settings.noise_widths)
        else:
            base, _ = optimizers.scratch_optimizer(job.optimizer, None, seed=1, only=sample.ids)
            fused, _ = optimizers.scratch_optimizer(job.optimizer, cand, seed=1, only=sample.ids)
            # An optimizer step reads only parameters, gradients and state: like a region, it
            # settles within its first calls (the first allocates the state), so it warms up
            # for a region's time, not for a whole step's.
            quick = dataclasses.replace(settings, warmup_seconds=settings.region_warmup_seconds)
            m = measure(Step(base.step, (), "optimizer step", scope="optimizer"),
                        Step(fused.step, ("fuse_optimizer",), "fused step", scope="optimizer"),
                        clock=clock, settings=quick, min_speedup=min_speedup, deadline=deadline,
                        early=clearly_one_way(min_speedup, quick))
            keep, reason = decide(m, min_speedup, settings.noise_widths)
            # (finite figures or None: a cut-short warm-up has no pair)
            figures = {**m.to_dict(), "sample": sample.to_dict()}
            speedup, noise = figures["speedup"], figures["noise"]
            if knowledge_base is not None and m.storable(settings.min_pairs):
                knowledge_base.put(key, {**figures, "pass": "fuse_optimizer",
                                         "example": cand.description})
        timed_on = (figures or {}).get("sample") or {}
        on = f" (timed on {timed_on['description']}; saving scaled to all)" if timed_on.get("scale", 1) != 1 else ""
        decision = Decision("fuse_optimizer", keep, "kept" if keep else "rejected",
                            f"{cand.description}, on its own step{on}: {reason}",
                            speedup=speedup, noise=noise, max_abs_error=err,
                            sites=[cand.description], measurement=figures, scope="step")
        if keep:
            return decision, cand
        tried.append(decision.reason)
    return Decision("fuse_optimizer", False, "rejected", "; ".join(tried),
                    sites=[c.description for c in found], scope="step"), None


def step_saved_ms(measurement: dict | None) -> float | None:
    """The whole step's predicted saving from a decision's figures (timed on a sample: scaled)."""
    saved = saved_ms(measurement)
    if saved is None:
        return None
    return saved * ((measurement or {}).get("sample") or {}).get("scale", 1.0)


def optimizer_numerics(optimizer, cand: optimizers.OptimizerCandidate, only: Collection[int] | None = None
                       ) -> tuple[bool, str, float | None]:
    try:
        base, base_params = optimizers.scratch_optimizer(optimizer, None, only=only, max_numel=NUMERICS_MAX_NUMEL)
        fused, fused_params = optimizers.scratch_optimizer(optimizer, cand, only=only, max_numel=NUMERICS_MAX_NUMEL)
        start = [p.detach().clone() for p in base_params]  # the fused copies start the same
        for _ in range(OPTIMIZER_STEPS):
            base.step()
            fused.step()
    except Exception as e:
        return False, f"raised: {type(e).__name__}: {e}", None
    # the updates, in fp64: a difference of fp32 parameters is exact there
    got = {f"param {i}": p.detach().double() - p0.double() for i, (p, p0) in enumerate(zip(fused_params, start))}
    want = {f"param {i}": p.detach().double() - p0.double() for i, (p, p0) in enumerate(zip(base_params, start))}
    c = compare_runs(got, want, OPTIMIZER_TOLERANCE)
    return c.ok, c.describe(), c.max_abs_error
