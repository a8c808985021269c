"""Verifying a compiled training step that draws dropout with the masks eager draws, so it is not
compiled a second time with dropout off.

A compiled graph draws its dropout masks its own way, so a compiled step that draws dropout was
verified in a compile with dropout off (``verify.dropout_disabled``: Dynamo traces again under it):
a second whole compile. GPT-2 with dropout 0.1, bf16, 4 layers, 2-core Xeon with AMX,
optimize(steps=20000): 33.8 s of compile, then 21.9 s of verifying, 62.7 s in all. With
Inductor's ``fallback_random`` its graphs draw random numbers with eager's ops, in the order the
model draws them: from the same seed, the compiled step and the eager model draw the same masks
(tiny GPT-2, fp32: loss equal to 1e-7, gradients to 1e-6 relative; at the benchmark size in bf16
against the eager model under autocast, whole and blocks nested: loss to 1e-5, gradients within
1.3 %, the bf16 rounding), so the compiled form is verified with dropout on, as any compiled form
is (the original's numerics, the autocast run as the yardstick), without compiling again. It is
also no slower: GPT-2 as above, the compiled step with ``fallback_random`` 1.084x ±0.017 the one
with Inductor's own random numbers (side by side in one process). Inductor on CPU only (where it
was measured). A comparison that fails falls back to the compile with dropout off, as before::

    runner = CompiledOriginal(model, cap, inductor, autocast, same_masks=True)
    ok, detail, err = verify_with_masks(run, runner, autocast)
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch

from rewriter.decide.job import UnderAutocast
from rewriter.decide.run_view import RunView
from rewriter.decide.verify import AUTOCAST_FACTOR, Yardstick, compare_runs, dropout_disabled, tolerance_for
from rewriter.devices.executors import has_dropout

log = logging.getLogger("rewriter.progress")


def verify_with_masks(r: RunView, runner: Any, autocast: tuple[str, torch.dtype] | None
                      ) -> tuple[bool, str, float | None]:
    """``runner`` (the original model compiled with ``fallback_random``) against the eager model,
    both with dropout on from the same seed, as every compiled form is verified: against the
    original's numerics at the precision's tolerance, beyond it within twice the deviation of the
    eager run under ``autocast`` (its precision; the yardstick), which draws the same masks (a
    dropout mask does not depend on its input's dtype on CPU). (ok, words, max error)."""
    job = r.job
    on = contextlib.nullcontext()  # dropout as the model has it
    try:
        with r._phase("verify"):
            want = job.numerics(job.model, deterministic=on)
            r.snapshot.restore()
            yardstick = job.numerics(UnderAutocast(job.model, autocast), deterministic=on) if autocast else None
            r.snapshot.restore()
            got = job.numerics(runner, deterministic=on)
    except Exception as e:
        return False, f"with dropout on, it raised: {type(e).__name__}: {e}", None
    finally:
        r.snapshot.restore()
    tol = tolerance_for(job.dtype)
    c = compare_runs(got, want, tol)
    if not c.ok and yardstick is not None:
        c = compare_runs(got, want, tol, yardstick=Yardstick("torch.autocast", yardstick, 2 * AUTOCAST_FACTOR))
    return c.ok, f"{c.describe()}; dropout on, the same masks as the eager model (Inductor's fallback_random)", \
        c.max_abs_error


def verify_compiled(r: RunView, runner: Any, masks: bool, autocast: tuple[str, torch.dtype] | None
                    ) -> tuple[bool, str, float | None]:
    """A compiled form against the original's numerics, as a composed rewrite is: with the same
    masks where ``masks`` (the original model compiled, its ``autocast``), else dropout off (a
    compiled graph with dropout: in a compile with it off, once more). (ok, words, max error)."""
    if masks:
        ok, detail, err = verify_with_masks(r, runner, autocast)
        if ok:
            return ok, detail, err
        log.info("rewriter: compile: not verified with the same masks (%s); with dropout off", detail)
    quiet = dropout_disabled() if r.job.training and has_dropout(r.cap, r.job.model) \
        else contextlib.nullcontext()
    try:
        with r._phase("verify"):
            got = r.job.numerics(runner, deterministic=quiet)
    except Exception as e:
        return False, f"the compiled model raised when run: {type(e).__name__}: {e}", None
    finally:
        r.snapshot.restore()
    tol = tolerance_for(r.job.dtype)
    c = compare_runs(got, r.reference.values, tol)
    if not c.ok:
        y = r.reference.yardstick()
        if y is not None:  # the rewrites' rounding and the compiler's add up, as composed
            y = dataclasses.replace(y, factor=2 * y.factor)
        c = compare_runs(got, r.reference.values, tol, yardstick=y)
    return c.ok, c.describe(), c.max_abs_error
