"""The facts a reader looks for first, computed from a run's rows: each configuration's geometric
mean, and where optimize() stands against the peers on each model, noise included.

    lines = reading_lines(results.rows)   # Markdown bullets, one per mode and optimize() config

A gap counts as a gap only beyond two noise widths of the two rows together (each row has its
own eager baseline, so two rows of one model differ by their combined noise even when the
configurations are the same); within that, the rows are "level".
"""
from __future__ import annotations

import math
from typing import Iterable, Protocol

MODE_NAMES = {"train": "training step", "infer": "inference"}


class RowLike(Protocol):
    model: str
    mode: str
    config: str
    label: str
    speedup: float | None
    noise: float | None
    error: str | None


def reading_lines(rows: Iterable[RowLike]) -> list[str]:
    """Bullets: per mode, each configuration's geomean; per optimize() configuration, the models
    where it leads every peer, is level with the best, or is behind (by how much)."""
    rows = [r for r in rows if r.speedup is not None and not r.error and r.config != "eager"]
    lines: list[str] = []
    for mode in ("train", "infer"):
        mine = [r for r in rows if r.mode == mode]
        if not mine:
            continue
        models = unique(r.model for r in mine)
        configs = unique((r.config, r.label) for r in mine)
        means = []
        for config, label in configs:
            values = [r.speedup for r in mine if r.config == config]
            means.append(f"{label} {geomean(values):.2f}x" + (f" ({len(values)} of {len(models)})"
                                                             if len(values) < len(models) else ""))
        lines.append(f"- {MODE_NAMES[mode].capitalize()}, geometric mean over {len(models)} "
                     f"model(s): " + ", ".join(means) + ".")
        peers = [c for c, _ in configs if not c.startswith("optimize")]
        for config, label in configs:
            standing = _standing(mine, config, peers, models) if config.startswith("optimize") else []
            if standing:
                lines.append(f"- {label} against the best peer on each model: "
                             + "; ".join(standing) + ".")
    return lines or ["- No row was measured."]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _standing(rows: list[RowLike], config: str, peers: list[str], models: list[str]) -> list[str]:
    out = []
    for model in models:
        by = {r.config: r for r in rows if r.model == model}
        mine = by.get(config)
        rivals = [by[p] for p in peers if p in by]
        if mine is None or not rivals:
            continue
        best = max(rivals, key=lambda r: r.speedup)
        gap = mine.speedup - best.speedup
        noise = 2 * math.hypot(mine.noise or 0.0, best.noise or 0.0)
        verdict = ("ahead" if gap > noise else "behind" if -gap > noise else "level")
        out.append(f"{model} {verdict} ({mine.speedup:.2f}x, {best.label} {best.speedup:.2f}x, "
                   f"±{noise:.2f})")
    return out


def unique(items: Iterable) -> list:
    """The items in first-seen order, once each (items need not be hashable)."""
    seen: list = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
