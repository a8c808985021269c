"""A run's rows and its three outputs: ``RESULTS.md``, ``results.json``, ``results.png``.

    results = Results(command=..., machine=machine_info(), settings={...})
    results.rows.append(Row(model="gpt2", mode="train", config="optimize", label="optimize()"))
    paths = write_outputs(results, "benchmarks/")

The chart needs matplotlib; without it the Markdown and JSON are written and the chart is not.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.measure import MEMORY_METHOD, isa_text
from benchmarks.reading import reading_lines, unique as _unique

MARKDOWN, JSON, CHART = "RESULTS.md", "results.json", "results.png"
READING_INTRO = ("Computed from the rows above (`benchmarks/reading.py`); a hand-written reading "
                 "of a final run goes below it.")


@dataclass
class Row:
    model: str
    mode: str                        # "train" | "infer"
    config: str
    label: str
    step_ms: float | None = None     # this configuration's median step
    spread_ms: float | None = None   # interquartile range of its steps
    eager_ms: float | None = None    # eager's median step, in the same comparison
    speedup: float | None = None     # median of paired ratios eager / configuration
    noise: float | None = None       # standard error of that median
    pairs: int = 0
    peak_mb: float | None = None
    optimize_s: float | None = None  # wall time of optimize()
    profile_s: float | None = None   # of which profiling the step before and after
    first_step_s: float | None = None  # the first step after setup: torch.compile compiles here
    rel_error: float | None = None   # max |out - eager| / max |eager| on the first step
    notes: list[str] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    error: str | None = None
    times_ms: dict[str, list[float]] = field(default_factory=dict)  # {"eager": [...], "config": [...]}
    faults: dict[str, float] | None = None  # median host page faults a step: {"eager", "config"}


@dataclass
class Results:
    command: str
    machine: dict
    settings: dict
    models: dict[str, dict] = field(default_factory=dict)  # "<mode>/<model>": description, seconds
    rows: list[Row] = field(default_factory=list)
    total_seconds: float = 0.0
    load_average_at_end: float | None = None

    def to_dict(self) -> dict:
        return _json_safe(asdict(self))


def write_outputs(results: Results, out_dir: str) -> dict[str, str]:
    """Write the Markdown, JSON and (with matplotlib) chart; return their paths by kind."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, JSON), "markdown": os.path.join(out_dir, MARKDOWN)}
    with open(paths["json"], "w") as f:
        json.dump(results.to_dict(), f, indent=1)
    chart = write_chart(results, os.path.join(out_dir, CHART))
    if chart:
        paths["chart"] = chart
    with open(paths["markdown"], "w") as f:
        f.write(to_markdown(results, chart_name=CHART if chart else None))
    return paths


# --- Markdown ------------------------------------------------------------------------------

MODES = {"train": "Training step (forward, loss, backward, AdamW step)",
         "infer": "Inference (forward under no_grad)"}


def to_markdown(results: Results, chart_name: str | None = None) -> str:
    m = results.machine
    isa = isa_text(m)
    lines = ["# Benchmarks: optimize() beside eager, torch.compile and hand-tuned forms", "",
             f"Command: `{results.command}`", "",
             "## Machine", "",
             "| | |", "|---|---|",
             f"| CPU | {m.get('cpu')} ({isa}) |",
             f"| cores | {m.get('cpu_count')} (torch threads: {m.get('torch_threads')}) |",
             f"| torch | {m.get('torch')} |",
             f"| transformers | {m.get('transformers')} |",
             f"| python | {m.get('python')} |",
             f"| date | {m.get('date')} |",
             f"| load average (1 min) at start / end | {m.get('load_average_at_start')} / {results.load_average_at_end} |",
             f"| run time | {results.total_seconds / 60:.1f} min |",
             "", "## Method", "", *_method_lines(results)]
    for mode in ("train", "infer"):
        rows = [r for r in results.rows if r.mode == mode]
        if rows:
            lines += ["", f"## {MODES[mode]}: speedup over eager", "", *_summary_table(rows)]
            if chart_name:  # one chart, a panel per mode: shown under the first table
                lines += ["", f"![speedup over eager]({chart_name})"]
                chart_name = None
            lines += ["", f"## {MODES[mode]}: details"]
            for model in _unique(r.model for r in rows):
                lines += ["", *_model_section(results, mode, model, [r for r in rows if r.model == model])]
    lines += ["", "## Reading", "", READING_INTRO, "", *reading_lines(results.rows)]
    return "\n".join(lines) + "\n"


def _method_lines(results: Results) -> list[str]:
    s = results.settings
    gate = s.get("gate", {})
    return [
        "- Models have random weights, built from configs (nothing downloaded); dropout is 0. "
        "Every configuration has its own copy of the model, weights identical to eager's, and "
        "its own optimizer.",
        f"- **speedup**: eager step time / configuration step time, the median of paired ratios, "
        f"eager and the configuration interleaved (A B, B A, ...) after warm-up, in this one "
        f"process (`rewriter.decide.gate.measure`; {gate.get('min_pairs')}-{gate.get('max_pairs')} pairs, "
        f"stopping early once clear of 1 by two noise widths or after {gate.get('budget_seconds')} s). "
        "**±** is the noise: the standard error of that median. The eager row is eager against "
        "a second eager copy: its distance from 1.00 is the noise floor.",
        "- **step ms**: the configuration's median step; **spread**: the interquartile range of "
        "its steps; **eager ms**: eager's median in the same comparison.",
        "- **page faults a step**: the host's page faults during a step (median), eager -> the "
        "configuration, in the same comparison: a step that maps fresh memory pays for every "
        "page, and whether it does depends on the allocator's state in this process as well as "
        f"on the model. Host allocator: {s.get('host_memory', 'not recorded')}.",
        f"- **peak MB**: {MEMORY_METHOD}.",
        "- **optimize s**: wall time of the `optimize()` call (it measures every rewrite it tries; "
        f"default settings{', profile off, few pairs' if s.get('quick') else ''}; in brackets, the "
        "part spent profiling the step before and after for the report, its tables built later, "
        "when the report is first read; knowledge base: "
        f"{s.get('knowledge_base', 'not recorded')}). "
        "**first step s**: the first step after setup; for the torch.compile rows this is the "
        "compile (forward and backward). Inductor's cache is fresh at the start of the run and "
        "shared within it, so `optimize() + compile()` may reuse kernels the `torch.compile` "
        "row built.",
        "- **rel. error**: max |output - eager output| / max |eager output| (logits), on the "
        "first step, from identical weights and inputs. bf16 rows show ~1e-2 by design.",
    ]


def _summary_table(rows: list[Row]) -> list[str]:
    configs = _unique((r.config, r.label) for r in rows)
    lines = ["| model | " + " | ".join(label for _, label in configs) + " |",
             "|---|" + "---|" * len(configs)]
    for model in _unique(r.model for r in rows):
        by_config = {r.config: r for r in rows if r.model == model}
        cells = [_speedup_cell(by_config.get(c)) for c, _ in configs]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def _speedup_cell(r: Row | None) -> str:
    if r is None:
        return "-"
    if r.error:
        return "error"
    return _speedup(r)


def _speedup(r: Row) -> str:
    if r.speedup is None:
        return "-"
    return f"{r.speedup:.2f}x ±{r.noise:.2f}" if r.noise is not None else f"{r.speedup:.2f}x"


def faults_text(r: Row) -> str:
    """Eager's and the configuration's median page faults a step, as ``eager -> config``."""
    if not r.faults:
        return "-"
    return f"{r.faults['eager']:.0f} -> {r.faults['config']:.0f}"


def _optimize_s(r: Row) -> str:
    """optimize()'s wall time, and how much of it was profiling (the issue's figures leave
    profiling aside)."""
    if r.optimize_s is None or not r.profile_s:
        return _num(r.optimize_s, '.1f')
    return f"{r.optimize_s:.1f} ({r.profile_s:.1f} profiling)"


def _model_section(results: Results, mode: str, model: str, rows: list[Row]) -> list[str]:
    info = results.models.get(f"{mode}/{model}", {})
    about = (f"{info['description']}. Expert form: {info['expert']}." if "description" in info
             else "Not built (see the rows).")
    lines = [f"### {model}", "", f"{about} Rows took {info.get('seconds', 0):.0f} s.", "",
             "| config | step ms | spread ms | eager ms | speedup | page faults a step | peak MB | optimize s | first step s | rel. error | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.label} | - | - | - | - | - | - | {_num(r.optimize_s, '.1f')} | - | - | "
                         f"**failed**: {_cell(r.error)} |")
            continue
        lines.append(f"| {r.label} | {_num(r.step_ms, '.3g')} | {_num(r.spread_ms, '.2g')} | "
                     f"{_num(r.eager_ms, '.3g')} | {_speedup(r)} | {faults_text(r)} | {_num(r.peak_mb, '.1f')} | "
                     f"{_optimize_s(r)} | {_num(r.first_step_s, '.2f')} | "
                     f"{_num(r.rel_error, '.1e')} | {_cell('; '.join(r.notes))} |")
    for r in rows:
        if r.decisions:
            lines += ["", f"{r.label} decisions: {_decisions(r.decisions)}."]
    return lines


_NOT_TRIED = ("no sites", "not applicable")


def _decisions(decisions: list[dict]) -> str:
    """The passes that found sites, with their measured speedup; the rest counted."""
    tried = []
    for d in decisions:
        if d["status"] in _NOT_TRIED:
            continue
        speed = f" {d['speedup']:.2f}x" if d.get("speedup") is not None else ""
        sites = f" ({d['sites']} sites)" if d.get("sites") and d["pass"] != "fuse_optimizer" else ""
        tried.append(f"{d['pass']}{sites} {d['status']}{speed}")
    idle = sum(1 for d in decisions if d["status"] in _NOT_TRIED)
    return "; ".join(tried + ([f"{idle} other passes found no site or do not serve this device"] if idle else []))


def _num(x: float | None, fmt: str) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return "0" if x == 0 else format(x, fmt)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- chart ---------------------------------------------------------------------------------

def write_chart(results: Results, path: str) -> str | None:
    """Grouped bars: speedup over eager per model and configuration, noise as error bars.
    Returns the path, or None without matplotlib or without a measured row."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # Eager is the 1.0 line, not a bar.
    rows = [r for r in results.rows if r.config != "eager" and r.speedup is not None and not r.error]
    modes = [m for m in ("train", "infer") if any(r.mode == m for r in rows)]
    if not modes:
        return None
    fig, axes = plt.subplots(len(modes), 1, figsize=(12, 5 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        mine = [r for r in rows if r.mode == mode]
        models = _unique(r.model for r in mine)
        configs = _unique((r.config, r.label) for r in mine)
        width = 0.8 / len(configs)
        for i, (config, label) in enumerate(configs):
            xs, ys, errs = [], [], []
            for j, model in enumerate(models):
                r = next((r for r in mine if r.model == model and r.config == config), None)
                if r is not None:
                    xs.append(j - 0.4 + (i + 0.5) * width)
                    ys.append(r.speedup)
                    errs.append(r.noise if r.noise is not None and math.isfinite(r.noise) else 0.0)
            ax.bar(xs, ys, width, yerr=errs, capsize=2, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_ylabel("speedup over eager (x), ± noise")
        ax.set_title(f"{MODES[mode]}; {results.machine.get('cpu')}, torch {results.machine.get('torch')}")
        ax.legend(fontsize=8, ncol=len(configs), loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 6) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
