"""The original model's numerics, and the yardstick runs computed only when first needed.

    ref = Reference(job, snapshot)
    ref.values            # outputs (and, training, parameter gradients) of one seeded run
    ref.yardstick()       # float64 for fp32 jobs, torch.autocast for dtype= jobs (or None)
    ref.float64()         # always float64: judges a capture, which is an fp32 graph
"""
from __future__ import annotations

from typing import Any

from rewriter.decide.job import Job
from rewriter.decide.verify import AUTOCAST_FACTOR, FLOAT64_FACTOR, Yardstick


class Reference:
    def __init__(self, job: Job, snapshot: Any) -> None:
        try:
            self.values = job.numerics(job.model)
        except Exception as e:
            raise ValueError(f"the model cannot run on the example inputs "
                             f"({type(e).__name__}: {e})") from e
        snapshot.restore()
        self._job, self._snapshot = job, snapshot
        self._cache: dict[str, Yardstick | None] = {}

    def _run(self, kind: str) -> Yardstick | None:
        if kind not in self._cache:
            if kind == "float64":
                values, factor = self._job.float64_numerics(), FLOAT64_FACTOR
            else:
                values, factor = self._job.autocast_numerics(), AUTOCAST_FACTOR
            self._snapshot.restore()
            self._cache[kind] = Yardstick(kind, values, factor) if values is not None else None
        return self._cache[kind]

    def float64(self) -> Yardstick | None:
        return self._run("float64")

    def yardstick(self) -> Yardstick | None:
        """float64 for fp32 verification, torch.autocast for ``dtype=`` (see rewriter.decide.verify);
        None where that run is not possible."""
        return self._run("float64" if self._job.dtype is None else "torch.autocast")
