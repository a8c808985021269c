"""The rows of a profile: one operator's line, one NPU kernel type's line, and what a whole
profile offers its readers (the advisor reads a profile through :class:`ProfileLike`, so it
needs nothing from rewriter.profiling, which renders the advisor's findings)::

    OpRow("aten::mm", calls=4, self_ms=3.2, total_ms=3.2, share=0.42)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

Shape = tuple[int, ...]
Signature = tuple[Shape, ...]  # the shapes of one call's inputs; () for a non-tensor input


@dataclass(frozen=True)
class OpRow:
    """One operator's line in a table, per profiled step.

    ``self_ms``/``total_ms`` are device time where the profile recorded a device (CUDA, NPU),
    else host (CPU) time; ``share`` is of the step's summed self time. ``input_shapes`` holds
    up to three input-shape signatures of the operator, most expensive first.
    """

    name: str
    calls: int
    self_ms: float
    total_ms: float
    share: float  # of the step's summed self time
    input_shapes: tuple[Signature, ...] = ()
    origin: str = ""  # the model line(s) it came from (with_stack profiles)
    roofline: str = ""  # "compute-bound, 35% of peak compute (...)", where it has a cost

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class KernelRow:
    """An NPU kernel type from ``kernel_details.csv`` (§3.3), per profiled step."""

    type: str
    accelerator_core: str  # AI_CORE, AI_VECTOR_CORE, AI_CPU, MIX_AIC, ...
    calls: int
    duration_ms: float
    input_dtypes: tuple[str, ...] = ()
    input_shapes: str = ""

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class ProfileLike(Protocol):
    """What a profile offers its readers (rewriter.profiling.ProfileResult is one)."""

    device: str
    steps: int
    rows: list[OpRow]
    shape_rows: list[OpRow]
    kernels: list[KernelRow]
    sequence: tuple[str, ...]
    wall_ms: float | None
    analysis: Any
    page_faults: int | None


def is_operator(name: str) -> bool:
    """An operator row (``aten::``/``npu::``), not an annotation such as ``ProfilerStep*``."""
    return name.startswith(("aten::", "npu::"))


def table_cell(text: str) -> str:
    """``text`` as one cell of a markdown table."""
    return text.replace("|", "\\|").replace("\n", " ")


def is_profile(x: Any) -> bool:
    """A whole profile (not a bare list of rows)."""
    return all(hasattr(x, a) for a in ("rows", "shape_rows", "kernels", "sequence", "device"))


__all__ = ["OpRow", "KernelRow", "ProfileLike", "Shape", "Signature", "is_profile", "is_operator",
           "table_cell"]


NO_MATPLOTLIB = "chart skipped: matplotlib is not installed (pip install matplotlib)"


def write_table_files(paths: dict[str, str], markdown: str, data: dict) -> dict[str, str]:
    """A table's two files: ``paths["table"]`` (Markdown) and ``paths["json"]``; returns ``paths``."""
    with open(paths["table"], "w") as f:
        f.write(markdown)
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=2)
    return paths
