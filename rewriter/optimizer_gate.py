"""The fused optimizer, gated on its own step (it has no region in the graph).

The update runs on scratch copies of the parameters, gradients and state (the user's are not
touched): first 5 steps from the same state must give the same parameters as the original
optimizer, then the two steps are timed side by side like any other candidate::

    decision, chosen = gate_optimizer(job, clock, gate_settings, min_speedup)
"""
from __future__ import annotations

from rewriter import optimizers
from rewriter.gate import Clock, GateSettings, Step, decide, measure
from rewriter.job import Job
from rewriter.report import Decision
from rewriter.verify import Tolerance, compare_runs

# The bar for a fused optimizer: 5 steps within 1e-5 of the original's parameters.
OPTIMIZER_STEPS = 5
OPTIMIZER_TOLERANCE = Tolerance(rtol=1e-5, atol_scale=1e-6)


def gate_optimizer(job: Job, clock: Clock, settings: GateSettings, min_speedup: float,
                   replace_allowed: bool = True, deadline: float | None = None
                   ) -> tuple[Decision, optimizers.OptimizerCandidate | None]:
    """Try the fused forms of the job's optimizer; the first that passes wins."""
    found, why_none = optimizers.candidates(job.optimizer, job.backend)
    if not replace_allowed:
        found = [c for c in found if c.flags is not None]
        why_none += "; optimize() without example inputs can only switch the optimizer in place"
    if not found:
        return Decision("fuse_optimizer", False, "not applicable", why_none, scope="step"), None
    tried = []
    for cand in found:
        ok, detail, err = optimizer_numerics(job.optimizer, cand)
        if not ok:
            tried.append(f"{cand.description}: failed verification ({detail})")
            continue
        base, _ = optimizers.scratch_optimizer(job.optimizer, None, seed=1)
        fused, _ = optimizers.scratch_optimizer(job.optimizer, cand, seed=1)
        m = measure(Step(base.step, (), "optimizer step", scope="optimizer"),
                    Step(fused.step, ("fuse_optimizer",), "fused step", scope="optimizer"),
                    clock=clock, settings=settings, min_speedup=min_speedup, deadline=deadline)
        keep, reason = decide(m, min_speedup, settings.noise_widths)
        decision = Decision("fuse_optimizer", keep, "kept" if keep else "rejected",
                            f"{cand.description}, on its own step: {reason}", speedup=m.speedup,
                            noise=m.noise, max_abs_error=err, sites=[cand.description],
                            measurement=m.to_dict(), scope="step")
        if keep:
            return decision, cand
        tried.append(decision.reason)
    return Decision("fuse_optimizer", False, "rejected", "; ".join(tried),
                    sites=[c.description for c in found], scope="step"), None


def optimizer_numerics(optimizer, cand: optimizers.OptimizerCandidate) -> tuple[bool, str, float | None]:
    try:
        base, base_params = optimizers.scratch_optimizer(optimizer, None)
        fused, fused_params = optimizers.scratch_optimizer(optimizer, cand)
        for _ in range(OPTIMIZER_STEPS):
            base.step()
            fused.step()
    except Exception as e:
        return False, f"raised: {type(e).__name__}: {e}", None
    got = {f"param {i}": p.detach() for i, p in enumerate(fused_params)}
    want = {f"param {i}": p.detach() for i, p in enumerate(base_params)}
    c = compare_runs(got, want, OPTIMIZER_TOLERANCE)
    return c.ok, c.describe(), c.max_abs_error
