"""The configurations compared: each is a way to run the same model's step.

Each configuration gets its own copy of the model (weights identical to eager's) and its own
optimizer, and returns a :class:`Variant` whose ``step()`` runs one step and returns the output::

    variant = CONFIGS["optimize"].prepare(setup)
    out = variant.step()

========================  ========================================================================
``eager``                 the model as built, fp32; ``AdamW(lr=1e-4, foreach=False)``
``optimize``              ``rewriter.optimize(model, inputs, optimizer=<the same AdamW>, loss_fn)``
``optimize_bf16``         the same with ``dtype=torch.bfloat16`` (precision-lowering passes allowed)
``compile``               ``torch.compile(model)`` (inductor), the same plain AdamW
``optimize_compile``      ``optimize()`` (the ``optimize`` row's plan replayed), then ``fast.compile()`` (Inductor)
``optimize_gated_compile``       ``optimize(compile=True)``: Inductor as a gated candidate on the rewritten graphs
``optimize_bf16_gated_compile``  the same with ``dtype=torch.bfloat16``
``optimize_steps100``     ``optimize(steps=100)``: defaults (``compile="auto"``), a 100-step run
``optimize_steps20k``     ``optimize(steps=20000)``: the same for a 20 000-step run
``optimize_bf16_steps20k``  the same with ``dtype=torch.bfloat16``
``optimize_bf16_steps100``   ``optimize(dtype=torch.bfloat16, steps=100)``: a short bf16 run
``expert``                the hand-tuned form (``ModelCase.make_expert``), ``AdamW(fused=True)``
``expert_autocast``       the same, forward and loss under ``torch.autocast(bfloat16)``
``compile_expert_autocast``  the same, its model compiled: torch.compile + SDPA + fused AdamW + autocast
========================  ========================================================================

Inference (``training=False``): the step is the forward under ``torch.no_grad()``; no optimizer.
"""
from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

import rewriter
from benchmarks.models import Inputs, ModelCase, call

LR = 1e-4
# --quick: optimize() decides on a few pairs, without the profiler (the test checks plumbing,
# not timings).
QUICK_OPTIMIZE_GATE = rewriter.GateSettings(warmup=1, warmup_seconds=0.0, max_warmup=1,
                                            min_pairs=3, max_pairs=4, budget_seconds=1.0)


@dataclass
class Setup:
    """What a configuration builds from."""

    case: ModelCase
    model: nn.Module     # this configuration's own copy (weights identical to eager's)
    training: bool
    quick: bool = False
    verbose: bool = False
    shared: dict = field(default_factory=dict)  # one model's rows: the optimize() plan
    passes: list[str] | None = None  # what optimize() tries (None: every registered pass)


@dataclass
class Variant:
    step: Callable[[], Any]                  # one step; returns the model's output
    optimize_seconds: float | None = None    # wall time of optimize(), where it ran
    profile_seconds: float | None = None     # of which optimize() spent profiling
    notes: list[str] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)  # optimize()'s report, in short
    after_first_step: Callable[[], list[str]] | None = None  # notes known only then


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    prepare: Callable[[Setup], Variant]


def make_step(model: Any, inputs: Inputs, *, optimizer: torch.optim.Optimizer | None,
              loss_fn: Callable[[Any], torch.Tensor] | None = None,
              autocast: bool = False) -> Callable[[], Any]:
    """One step as a user writes it: forward (and loss) [under autocast], backward, optimizer
    step, ``zero_grad``; without an optimizer, the forward under ``torch.no_grad()``."""
    def amp() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    if optimizer is None:
        def infer() -> Any:
            with torch.no_grad(), amp():
                return call(model, inputs)
        return infer

    def train() -> Any:
        with amp():
            out = call(model, inputs)
            loss = loss_fn(out) if loss_fn is not None else out.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out
    return train


def plain_optimizer(model: nn.Module, training: bool) -> torch.optim.Optimizer | None:
    """The optimizer users write (per-parameter loop); optimize() may switch it to fused."""
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=False) if training else None


def _eager(s: Setup) -> Variant:
    opt = plain_optimizer(s.model, s.training)
    return Variant(make_step(s.model, s.case.inputs, optimizer=opt, loss_fn=s.case.loss_fn),
                   notes=["eager against a second eager copy: the noise floor"])


def _run_optimize(s: Setup, dtype: torch.dtype | None, plan: dict | None = None,
                  compile: bool | str = False,
                  steps: int | None = None) -> tuple[Any, torch.optim.Optimizer | None, Variant]:
    opt = plain_optimizer(s.model, s.training)
    options: dict[str, Any] = {"optimizer": opt, "dtype": dtype, "plan": plan, "passes": s.passes,
                               "progress": s.verbose, "compile": compile, "steps": steps}
    if s.training:
        options["loss_fn"] = s.case.loss_fn
    if s.quick:
        options.update(gate=QUICK_OPTIMIZE_GATE, profile=False)
    started = time.perf_counter()
    result = rewriter.optimize(s.model, s.case.inputs, **options)
    seconds = time.perf_counter() - started
    fast, opt = result if opt is not None else (result, None)
    report = fast.report
    notes = [_summary(report)]
    notes += [n for n in report.notes if n.startswith("optimizer:")]
    notes += [_compile_note(d) for d in report.decisions if d.pass_name == "compile"]
    decisions = [{"pass": d.pass_name, "status": d.status, "speedup": d.speedup, "noise": d.noise,
                  "sites": len(d.sites), "reason": d.reason} for d in report.decisions]
    final = report.final
    decisions.append({"pass": "(whole model)", "status": "kept" if final.get("kept") else "original returned",
                      "speedup": final.get("speedup"), "noise": final.get("noise"), "sites": 0,
                      "reason": final.get("reason", "")})
    variant = Variant(make_step(fast, s.case.inputs, optimizer=opt, loss_fn=s.case.loss_fn),
                      optimize_seconds=seconds, profile_seconds=report.phases.get("profile"),
                      notes=notes, decisions=decisions)
    return fast, opt, variant


def _compile_note(d: Any) -> str:
    m = d.measurement or {}
    seconds = m.get("compile_seconds")
    spent = f", first compiled step {seconds:.1f} s" if seconds is not None else ""
    if m.get("predicted_compile_seconds") is not None:
        spent += f", predicted {m['predicted_compile_seconds']:.1f} s"
    if "steps" in m:
        be = m.get("break_even_step")
        spent += f", repaid {'never' if be is None else f'after {be} steps'} of steps={m['steps']}"
    return f"compile: {d.status}{spent}"


def _summary(report: rewriter.Report) -> str:
    if not report.final.get("kept", False):
        return f"original model runs ({report.final.get('reason', 'nothing kept')})"
    return "kept: " + ", ".join(report.kept_passes)


def _optimize(s: Setup) -> Variant:
    fast, _, variant = _run_optimize(s, None)
    s.shared["plan"] = fast.report.plan  # optimize_compile replays it instead of measuring again
    return variant


def _optimize_bf16(s: Setup) -> Variant:
    return _run_optimize(s, torch.bfloat16)[2]


def _optimize_gated_compile(s: Setup, dtype: torch.dtype | None = None) -> Variant:
    """optimize(compile=True): Inductor on the rewritten graphs, kept only when the whole step
    measures faster (optimize s includes the compile; see the row's compile note)."""
    return _run_optimize(s, dtype, compile=True)[2]


def _optimize_for_steps(s: Setup, steps: int, dtype: torch.dtype | None = None) -> Variant:
    """The defaults (compile="auto") told the run's length: a compile is paid only where it
    repays within a tenth of the run."""
    return _run_optimize(s, dtype, compile="auto", steps=steps)[2]


def _compile(s: Setup) -> Variant:
    opt = plain_optimizer(s.model, s.training)
    compiled = torch.compile(s.model)
    return Variant(make_step(compiled, s.case.inputs, optimizer=opt, loss_fn=s.case.loss_fn),
                   notes=["compile time: see 'first step s'"])


# Fused calls a kept rewrite puts in the graph; whether Inductor still sees them tells whether
# it compiled optimize()'s graphs or the model's own code.
_FUSED_CALLS = {"SDPA": re.compile(r"\bscaled_dot_product_attention\("),
                "embedding": re.compile(r"\bembedding\(")}


def _optimize_compile(s: Setup) -> Variant:
    plan = s.shared.get("plan")
    fast, opt, variant = _run_optimize(s, None, plan=plan)
    if plan is not None:
        variant.notes.insert(0, "optimize() replayed the optimize row's plan (not measured again)")
    seen: list[str] = []

    def inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from torch._inductor.compile_fx import (
            compile_fx,  # what backend="inductor" runs
        )
        seen.append(gm.code)
        return compile_fx(gm, example_inputs)

    fast.compile(backend=inductor)  # the rewritten graphs to Inductor (see OptimizedModel.compile)
    variant.step = make_step(fast, s.case.inputs, optimizer=opt, loss_fn=s.case.loss_fn)

    def what_inductor_saw() -> list[str]:
        ours = "\n".join(fast.graph_code().values())
        theirs = "\n".join(seen)
        notes = []
        for name, pattern in _FUSED_CALLS.items():
            want, got = len(pattern.findall(ours)), len(pattern.findall(theirs))
            if want > got:
                notes.append(f"Inductor received {got} of the {want} {name} calls optimize()'s "
                             "graphs run: it compiled the model's own code")
        return notes
    variant.after_first_step = what_inductor_saw
    return variant


def _expert(s: Setup, autocast: bool = False, compile: bool = False) -> Variant:
    model, inputs = s.case.make_expert(s.model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True) if s.training else None
    notes = [s.case.expert_description + (", AdamW(fused=True)" if s.training else "")]
    if compile:  # the expert's model compiled (the optimizer built on its parameters first)
        model = torch.compile(model)
        notes.append("torch.compile (inductor); compile time: see 'first step s'")
    return Variant(make_step(model, inputs, optimizer=opt, loss_fn=s.case.loss_fn, autocast=autocast),
                   notes=notes)


CONFIGS: dict[str, Config] = {c.name: c for c in (
    Config("eager", "eager fp32", _eager),
    Config("optimize", "optimize()", _optimize),
    Config("optimize_bf16", "optimize(dtype=bf16)", _optimize_bf16),
    Config("compile", "torch.compile", _compile),
    Config("optimize_compile", "optimize() + compile()", _optimize_compile),
    Config("optimize_gated_compile", "optimize(compile=True)", _optimize_gated_compile),
    Config("optimize_bf16_gated_compile", "optimize(dtype=bf16, compile=True)",
           lambda s: _optimize_gated_compile(s, torch.bfloat16)),
    Config("optimize_steps100", "optimize(steps=100)", lambda s: _optimize_for_steps(s, 100)),
    Config("optimize_steps20k", "optimize(steps=20000)", lambda s: _optimize_for_steps(s, 20_000)),
    Config("optimize_bf16_steps20k", "optimize(dtype=bf16, steps=20000)",
           lambda s: _optimize_for_steps(s, 20_000, torch.bfloat16)),
    Config("optimize_bf16_steps100", "optimize(dtype=bf16, steps=100)",
           lambda s: _optimize_for_steps(s, 100, torch.bfloat16)),
    Config("expert", "expert", _expert),
    Config("expert_autocast", "expert + autocast bf16", lambda s: _expert(s, autocast=True)),
    Config("compile_expert_autocast", "torch.compile + expert + autocast bf16",
           lambda s: _expert(s, autocast=True, compile=True)),
)}
CONFIG_NAMES = tuple(CONFIGS)
