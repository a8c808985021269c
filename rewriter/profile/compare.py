"""Before and after: two profiles (or operator tables) side by side, per operator, and a chart
of their top operators::

    c = compare(before, after)          # ProfileResult or lists of OpRow
    print(c.to_markdown())              # step time, then what got faster, slower, new, gone
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Sequence

from rewriter.profile.rows import NO_MATPLOTLIB, OpRow, ProfileLike, is_profile, write_table_files
from rewriter.profile.rows import is_operator as _is_operator
from rewriter.profile.rows import table_cell as _cell

log = logging.getLogger("rewriter.profiling")  # the logger users configure for profiling

# --- before/after ----------------------------------------------------------------------------

@dataclass(frozen=True)
class OpChange:
    """One operator before and after: ``vanished``, ``appeared``, ``faster``, ``slower`` or
    ``unchanged``; times are self ms per step (0.0 where absent)."""

    name: str
    status: str
    before_ms: float
    after_ms: float
    before_calls: int
    after_calls: int

    @property
    def delta_ms(self) -> float:
        return self.after_ms - self.before_ms

    def to_dict(self) -> dict:
        d = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        d["delta_ms"] = round(self.delta_ms, 4)
        return d


@dataclass
class Comparison:
    """Two operator tables side by side, largest change first.

        cmp = compare(before, after)
        [c.name for c in cmp.vanished]        # e.g. ['aten::softmax', 'aten::bmm', ...]
        cmp.save("prof/compare")
    """

    labels: tuple[str, str]
    before_step_ms: float
    after_step_ms: float
    changes: list[OpChange]
    before_peak_mb: float | None = None
    after_peak_mb: float | None = None
    notes: list[str] = field(default_factory=list)
    before_rows: list[OpRow] = field(default_factory=list, repr=False)
    after_rows: list[OpRow] = field(default_factory=list, repr=False)

    def _with(self, status: str) -> list[OpChange]:
        return [c for c in self.changes if c.status == status]

    @property
    def vanished(self) -> list[OpChange]:
        return self._with("vanished")

    @property
    def appeared(self) -> list[OpChange]:
        return self._with("appeared")

    @property
    def faster(self) -> list[OpChange]:
        return self._with("faster")

    @property
    def slower(self) -> list[OpChange]:
        return self._with("slower")

    def to_dict(self) -> dict:
        return {"labels": list(self.labels), "before_step_ms": round(self.before_step_ms, 4),
                "after_step_ms": round(self.after_step_ms, 4), "before_peak_mb": self.before_peak_mb,
                "after_peak_mb": self.after_peak_mb, "changes": [c.to_dict() for c in self.changes],
                "notes": list(self.notes)}

    def to_markdown(self, top_k: int = 15) -> str:
        a, b = self.labels
        lines = [f"## Operators before/after: {a} -> {b}", "", _step_line(self)]
        for title, changed in (("Vanished", self.vanished), ("Appeared", self.appeared)):
            items = [c for c in changed if _is_operator(c.name)]  # annotations are in the table
            if items:
                lines.append(f"- {title}: " + ", ".join(
                    f"`{c.name}` ({max(c.before_ms, c.after_ms):.3f} ms)" for c in items[:top_k])
                    + (f", and {len(items) - top_k} more" if len(items) > top_k else ""))
        lines.append(f"- Faster: {len(self.faster)} operators; slower: {len(self.slower)}")
        lines += ["", f"| operator | {_cell(a)} ms | {_cell(b)} ms | change | calls |",
                  "|---|---|---|---|---|"]
        lines += [f"| {_cell(c.name)} | {c.before_ms:.3f} | {c.after_ms:.3f} | {c.status} "
                  f"{c.delta_ms:+.3f} | {c.before_calls} -> {c.after_calls} |" for c in self.changes[:top_k]]
        lines += [f"- note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def save(self, out_dir: str | os.PathLike, top_k: int = 15) -> dict[str, str]:
        """Write ``comparison.md``, ``comparison.json`` and (with matplotlib) ``before_after.png``."""
        os.makedirs(out_dir, exist_ok=True)
        paths = {"table": os.path.join(out_dir, "comparison.md"),
                 "json": os.path.join(out_dir, "comparison.json")}
        chart = plot_top_ops(self.before_rows, self.after_rows, os.path.join(out_dir, "before_after.png"),
                             top_k=min(top_k, 12), labels=self.labels)
        if chart:
            paths["chart"] = chart
        else:
            self.notes.append(NO_MATPLOTLIB)
        return write_table_files(paths, self.to_markdown(top_k), self.to_dict())


def _step_line(c: Comparison) -> str:
    change = (c.after_step_ms / c.before_step_ms - 1) * 100 if c.before_step_ms else float("nan")
    line = (f"Operator self time per step: {c.before_step_ms:.2f} ms -> {c.after_step_ms:.2f} ms "
            f"({change:+.1f}%)")
    if c.before_peak_mb is not None and c.after_peak_mb is not None:
        line += f"; peak memory {c.before_peak_mb:.2f} MB -> {c.after_peak_mb:.2f} MB"
    return line + "."


def _table_of(x: ProfileLike | Sequence[OpRow]
              ) -> tuple[list[OpRow], float, float | None, str | None, bool]:
    """rows, step ms, peak MB, label, and whether the table is complete (not a top-k cut)."""
    if is_profile(x):
        return list(x.rows), x.step_ms, x.peak_memory_mb, x.label, True
    rows = list(x)
    if not all(isinstance(r, OpRow) for r in rows):
        raise ValueError("compare() takes ProfileResults or lists of OpRow")
    # A top-k list still knows the step: each row's share is of the whole step.
    ref = next((r for r in rows if r.share > 0), None)
    step = ref.self_ms / ref.share if ref else sum(r.self_ms for r in rows)
    return rows, step, None, None, False


def compare(before: ProfileLike | Sequence[OpRow], after: ProfileLike | Sequence[OpRow], *,
            min_change: float = 0.10, min_ms: float = 0.01,
            labels: tuple[str, str] | None = None) -> Comparison:
    """Which operators vanished, appeared, got faster or slower between two profiles.

    An operator is faster/slower when its self time per step changed by more than
    ``min_change`` (relative) and ``min_ms`` (absolute); profiles are single runs, so smaller
    changes are noise. Tables cut to their top k make vanished/appeared approximate::

        cmp = compare(profile_model(model, ...), profile_model(fast, ...))
        cmp.vanished, cmp.appeared, cmp.faster, cmp.slower
    """
    if min_change < 0 or min_ms < 0:
        raise ValueError(f"min_change and min_ms must be >= 0, got {min_change}, {min_ms}")
    b_rows, b_step, b_peak, b_label, b_full = _table_of(before)
    a_rows, a_step, a_peak, a_label, a_full = _table_of(after)
    names = list(dict.fromkeys([r.name for r in b_rows] + [r.name for r in a_rows]))
    b_by, a_by = {r.name: r for r in b_rows}, {r.name: r for r in a_rows}
    changes = [_change(n, b_by.get(n), a_by.get(n), min_change, min_ms) for n in names]
    changes.sort(key=lambda c: abs(c.delta_ms), reverse=True)
    notes = ["times are from profiled steps (profiler overhead included), not the gate's measurements"]
    if not (b_full and a_full):
        notes.append("a table was cut to its top operators: 'vanished'/'appeared' may mean 'left the top'")
    return Comparison(labels or (b_label or "before", a_label or "after"), b_step, a_step, changes,
                      b_peak, a_peak, notes, b_rows, a_rows)


def _change(name: str, b: OpRow | None, a: OpRow | None, min_change: float, min_ms: float) -> OpChange:
    b_ms, a_ms = (b.self_ms if b else 0.0), (a.self_ms if a else 0.0)
    if a is None:
        status = "vanished"
    elif b is None:
        status = "appeared"
    elif abs(a_ms - b_ms) >= min_ms and a_ms < b_ms * (1 - min_change):
        status = "faster"
    elif abs(a_ms - b_ms) >= min_ms and a_ms > b_ms * (1 + min_change):
        status = "slower"
    else:
        status = "unchanged"
    return OpChange(name, status, b_ms, a_ms, b.calls if b else 0, a.calls if a else 0)


# --- charts (matplotlib optional) ------------------------------------------------------------

def plot_top_ops(before: ProfileLike | Sequence[OpRow],
                 after: ProfileLike | Sequence[OpRow] | None = None,
                 path: str | os.PathLike = "top_operators.png", *, top_k: int = 10,
                 labels: tuple[str, str] = ("before", "after")) -> str | None:
    """A horizontal bar chart of self time per step of the top operators (two bars each with
    ``after``). Returns the path, or None when matplotlib is not installed::

        plot_top_ops(before, after, "before_after.png", labels=("eager", "optimized"))
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    except ImportError:
        log.info("matplotlib is not installed: chart %s skipped (pip install matplotlib)", path)
        return None
    b = {r.name: r.self_ms for r in (before.rows if is_profile(before) else before)}
    a = {r.name: r.self_ms for r in (after.rows if is_profile(after) else after or [])}
    names = sorted(set(b) | set(a), key=lambda n: max(b.get(n, 0.0), a.get(n, 0.0)), reverse=True)[:top_k]
    fig = Figure(figsize=(10, 1.5 + 0.4 * max(len(names), 1)))
    ax = fig.subplots()
    ys = list(range(len(names)))
    height = 0.4 if after is not None else 0.8
    ax.barh([y - (height / 2 if after is not None else 0) for y in ys], [b.get(n, 0.0) for n in names],
            height=height, label=labels[0])
    if after is not None:
        ax.barh([y + height / 2 for y in ys], [a.get(n, 0.0) for n in names], height=height, label=labels[1])
        ax.legend()
    ax.set_yticks(ys, [n if len(n) <= 48 else n[:45] + "..." for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("self time per step (ms)")
    ax.set_title("Top operators" + (f": {labels[0]} vs {labels[1]}" if after is not None else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)
