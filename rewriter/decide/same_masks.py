"""Verifying a compiled training step that draws dropout with the masks eager draws, so it is not
compiled a second time with dropout off.

A compiled graph draws its dropout masks its own way, so a compiled step that draws dropout was
verified in a compile with dropout off (``verify.dropout_disabled``: Dynamo traces again under it):
a second whole compile. GPT-2 with dropout 0.1, bf16, 4 layers, 2-core Xeon with AMX,
optimize(steps=20000): 33.8 s of compile, then 21.9 s of verifying, 62.7 s in all. With
Inductor's ``fallback_random`` its graphs draw random numbers with eager's ops, in the order the
model draws them: from the same seed, the compiled step and the eager model (under the same
autocast) draw the same masks (tiny GPT-2, fp32: loss equal to 1e-7, gradients to 1e-6 relative;
at the benchmark size in bf16, whole and blocks nested: loss to 1e-5, gradients within 1.3 %, the
bf16 rounding), so the compiled form is verified with dropout on, against that eager run, at the
precision's tolerance, without compiling again. It is also no slower: GPT-2 as above, the
compiled step with ``fallback_random`` 1.084x ±0.017 the one with Inductor's own random numbers
(side by side in one process). Inductor on CPU only (where it was measured). A comparison that
fails falls back to the compile with dropout off, as before::

    runner = CompiledOriginal(model, cap, inductor, autocast, same_masks=True)
    ok, detail, err = verify_with_masks(run, runner, autocast)
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from rewriter.decide.run_view import RunView
from rewriter.decide.verify import compare_runs, tolerance_for


def verify_with_masks(r: RunView, runner: Any, autocast: tuple[str, torch.dtype] | None
                      ) -> tuple[bool, str, float | None]:
    """``runner`` (the original model compiled with ``fallback_random``) against the eager model
    under ``autocast`` (its precision), both with dropout on from the same seed: (ok, words, max
    error)."""
    job = r.job

    def eager(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
            return job.model(*args, **kwargs)
    on = contextlib.nullcontext()  # dropout as the model has it
    try:
        with r._phase("verify"):
            want = job.numerics(eager, deterministic=on)
            r.snapshot.restore()
            got = job.numerics(runner, deterministic=on)
    except Exception as e:
        return False, f"with dropout on, it raised: {type(e).__name__}: {e}", None
    finally:
        r.snapshot.restore()
    c = compare_runs(got, want, tolerance_for(job.dtype))
    where = "the eager model" + (f" under autocast {str(autocast[1]).split('.')[-1]}" if autocast else "")
    return c.ok, f"{c.describe()} against {where}, dropout on, the same masks (Inductor's fallback_random)", \
        c.max_abs_error
