"""The ``rewriter`` command line: the offline rewrite script.

    rewriter demo [--out DIR]        optimize the built-in example and print the report
    rewriter demo --generate         serve a small causal LM: prefill and decode decided,
                                     greedy generate(), tokens/s, which graphs ran rewritten
    rewriter optimize SPEC --out DIR [--train] [--dtype bf16|fp16] [--plan PLAN]
                     [--cache-dir DIR] [--loss SPEC] [--input SHAPE ...] [--device DEV]
                     [--bind-cores] [--aoe DIR] [--objective time|memory] [--memory-slowdown S]
    rewriter profile SPEC --out DIR [--train] [--steps N] [--peaks auto|none|DEVICE|FILE]
                                     profile one model's step: operator table, roofline,
                                     model lines, shape outliers, advisor, and the memory
                                     view (peak and when, top allocators, live memory chart:
                                     memory.md/json, memory.png with matplotlib)

SPEC is ``package.module:factory`` or ``path/to/file.py:factory``; the factory returns the
model, or ``(model, example_inputs)`` with a tuple of args or a dict of kwargs. Only that
factory runs (the file is imported, not run as a script); nothing is unpickled.

``optimize`` writes into DIR: ``plan.json`` (replay it with --plan: no measuring),
``report.json``, ``report.md``, ``traces/`` (one profiled eager and one optimized step each as
a Chrome trace, a TensorBoard trace, an operator table and chart, and their comparison), and
``graphs/`` (the rewritten graph code: for a whole-model fx capture a loadable module that runs
on the original model's parameters, for Dynamo each graph's code); it ends with a summary
table. Examples:

    rewriter optimize models/gpt.py:build --train --out out/
    rewriter optimize models/gpt.py:build --train --plan out/plan.json --out out2/
    rewriter optimize mypkg.nets:resnet --input 8x3x224x224 --bind-cores --out out/
    rewriter profile models/gpt.py:build --train --out prof/
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}


def _say(message: str) -> None:
    """A progress line for the person at the terminal (stderr, beside the library's lines)."""
    print(f"rewriter: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress_shown() -> Iterator[None]:
    """Show the library's progress lines on stderr for the whole command.

    optimize() shows them only when nothing has configured logging; the script wants them
    whenever it runs (under a host application or a test runner too)."""
    logger = logging.getLogger("rewriter.progress")
    if logger.handlers:  # someone chose where progress goes
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# --- demo ----------------------------------------------------------------------------------

def _demo(args: argparse.Namespace) -> int:
    import rewriter
    from rewriter.examples import tuned_block

    if args.generate:
        return _demo_generate(args)

    model, inputs = tuned_block()
    print(f"rewriter demo: {type(model).__name__} on {inputs[0].shape[0]}x{inputs[0].shape[1]} "
          f"tokens, inference, torch {torch.__version__}, cpu threads {torch.get_num_threads()}",
          file=sys.stderr)
    fast = rewriter.optimize(model, example_inputs=inputs)
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    print(fast.report.to_markdown())
    if args.out:
        fast.report.save(args.out)
        print(f"report and plan written to {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


def _demo_generate(args: argparse.Namespace) -> int:
    """Serve a small causal LM: optimize() on its prompt (prefill and decode decided), then
    greedy generate() through the result, its tokens/s, and which signatures ran rewritten."""
    import rewriter
    from rewriter.examples import tiny_causal_lm

    model, prompt = tiny_causal_lm()
    new_tokens = 48
    print(f"rewriter demo --generate: {type(model).__name__} ({model.config.num_hidden_layers} "
          f"layers), prompt 1x{prompt.shape[1]}, {new_tokens} new tokens, torch {torch.__version__}, "
          f"cpu threads {torch.get_num_threads()}", file=sys.stderr)
    def generate(m: Any, n: int) -> torch.Tensor:  # the serving loop's one call
        with torch.no_grad():
            return m.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    want = generate(model, new_tokens)  # the original's tokens, as many as fast will give
    fast = rewriter.optimize(model, example_inputs=(prompt,), clock=_make_clock())
    print(fast.report.to_markdown())

    def serve(n: int) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        out = generate(fast, n)
        return out, time.perf_counter() - started

    before = {g["graph"]: g["runs"] for g in fast.graph_runs()}
    got, _ = serve(new_tokens)
    ran = [g for g in fast.graph_runs() if g["runs"] > before.get(g["graph"], 0)]
    firsts = [serve(1)[1] for _ in range(3)]
    wholes = [serve(new_tokens)[1] for _ in range(3)]
    prefill, whole = statistics.median(firsts), statistics.median(wholes)
    print("## Serving (this process, fast.generate; rates, not a comparison: see benchmarks/generate.py)\n")
    print(f"- tokens identical to the original model's: {bool(torch.equal(got, want))}")
    print(f"- prefill: {prompt.shape[1] / prefill:.0f} tokens/s; decode: "
          f"{(new_tokens - 1) / max(whole - prefill, 1e-9):.0f} tokens/s (median of 3)")
    print("- graphs that ran in one generate(): " + (", ".join(
        f"{g['graph']} ({g['runs'] - before.get(g['graph'], 0)} runs, "
        f"{'rewritten' if g['rewritten'] else 'as captured'})" for g in ran) or
        f"none: the original model runs ({fast.report.final.get('reason', '')})"))
    if args.out:
        fast.report.save(args.out)
        print(f"report and plan written to {os.path.abspath(args.out)}", file=sys.stderr)
    fast.restore()
    return 0 if torch.equal(got, want) else 1


# --- optimize ------------------------------------------------------------------------------

def _make_clock() -> Any:
    """The gate's clock: None is the wall clock. Tests substitute a controlled one here."""
    return None


def _gate_settings(args: argparse.Namespace) -> Any:
    """Measuring budget from the options (tests substitute a quick one here)."""
    import rewriter
    return rewriter.GateSettings(budget_seconds=args.budget) if args.budget else None


@dataclass
class _Job:
    """The model a SPEC builds, ready to run as the options say."""

    model: nn.Module
    inputs: tuple | dict
    optimizer: torch.optim.Optimizer | None
    loss_fn: Callable[[Any], torch.Tensor] | None

    @property
    def args_kwargs(self) -> tuple[tuple, dict]:
        return (self.inputs, {}) if isinstance(self.inputs, tuple) else ((), self.inputs)


def _build(args: argparse.Namespace) -> _Job:
    """Call the SPEC's factory, load the --loss function (the only user code that runs), then
    set up inputs, device, mode and optimizer as the options say."""
    from rewriter import spec

    if args.loss and not args.train:
        raise ValueError("--loss is for training; add --train")
    if args.device:
        kind, _, index = args.device.partition(":")
        if kind not in ("cpu", "cuda", "npu") or (index and not index.isdigit()):
            raise ValueError(f"--device {args.device!r}: expected cpu, cuda[:i] or npu[:i]")
    _say(f"building the model from {args.spec}")
    model, inputs = spec.build_model(args.spec)
    if inputs is None:
        inputs = spec.make_inputs(args.input, model)
    elif args.input:
        raise ValueError(f"the factory {args.spec} returned example inputs; --input is only for "
                         "factories that return just the model")
    model, inputs = _to_device(model, inputs, args.device)
    loss_fn = spec.load_callable(args.loss, "loss function") if args.loss else None
    optimizer = None
    if args.train:
        model.train()
        if args.optimizer != "none":
            optimizer = _OPTIMIZERS[args.optimizer](model.parameters())
    else:
        model.eval()
    return _Job(model, inputs, optimizer, loss_fn)


_COMPILE = {"auto": "auto", "on": True, "off": False}


def _optimize(args: argparse.Namespace) -> int:
    import rewriter
    from rewriter import plan as plans
    from rewriter.devices import host

    started, started_at = time.perf_counter(), time.time()
    out = os.path.abspath(args.out)
    _check_writable(out)  # before anything is built or measured
    if args.plan:
        plans.load_plan(args.plan)  # a corrupt plan fails now, naming the file
    if args.aoe:
        host.check_aoe(cores_bound=args.bind_cores)
    host_lines: list[str] = []
    if args.bind_cores:
        try:
            host_lines.append(f"cores: {host.bind_cores(args.device)}")
        except (OSError, RuntimeError, ValueError) as e:  # an optional setting: report, go on
            host_lines.append(f"cores: not bound: {e}")
        _say(host_lines[-1])

    job = _build(args)
    notes: list[str] = []
    traces = os.path.join(out, "traces")
    before = None
    if not args.no_traces:
        before = _profile(job.model, job, "eager", os.path.join(traces, "eager"), job.optimizer,
                          notes)

    mode = "training" if args.train else "inference"
    _say(f"optimizing {type(job.model).__name__} ({mode}, "
         f"{'replaying ' + args.plan if args.plan else 'measuring each rewrite'})")
    result = rewriter.optimize(
        job.model, job.inputs, optimizer=job.optimizer, loss_fn=job.loss_fn,
        dtype=_DTYPES[args.dtype] if args.dtype else None, passes=_names(args.passes),
        exclude=_names(args.exclude) or (), device=args.device, min_speedup=args.min_speedup,
        plan=args.plan, cache_dir=args.cache_dir, front_end=args.front_end,
        compile=_COMPILE.get(args.compile, args.compile), steps=args.steps,
        objective=args.objective, memory_slowdown=args.memory_slowdown,
        profile=False,  # profiled below, once per variant, with traces; its tables fill the report
        progress=True, gate=_gate_settings(args), clock=_make_clock())
    fast, fast_opt = result if job.optimizer is not None else (result, None)
    report = fast.report

    _say("writing the rewritten graph code")
    export = _export_graphs(fast, job, os.path.join(out, "graphs"))
    notes.append(f"graph code: {export.note}")
    optimized = report.final.get("kept", False)
    after = None
    if args.no_traces:
        notes.append("no profiles or traces (--no-traces)")
    elif optimized:
        after = _profile(fast, job, "optimized", os.path.join(traces, "optimized"), fast_opt, notes)
    else:
        notes.append("no optimized profile: the original model is what runs")
    _compare(before, after, os.path.join(traces, "compare"), report, notes)
    report.notes += [f"host: {line}" for line in host_lines] + notes
    report.save(out)

    if args.aoe:
        host_lines += _dump_aoe(fast, fast_opt, job, args, report, out)
    written = _files_under(out, since=started_at)  # not what an earlier run left there
    print(_summary(report, out, written, host_lines, time.perf_counter() - started))
    return 0


def _profile(run: nn.Module, job: _Job, label: str, directory: str, optimizer: Any,
             notes: list[str]) -> Any:
    """Profile one step of ``run`` into ``directory`` (Chrome trace, TensorBoard, tables);
    the model and optimizer come out unchanged. None, with a note, when profiling fails."""
    from rewriter.profiling import ProfileSettings, profile_model

    # One discarded warm-up step (first-call work: lazy optimizer state, allocator; torch's
    # profiler warns without one), then one recorded step.
    settings = ProfileSettings(wait=0, warmup=1, active=1)
    _say(f"profiling the {label} step -> {directory}")
    try:
        return profile_model(run, job.inputs, training=job.model.training, loss_fn=job.loss_fn,
                             optimizer=optimizer, steps=1, out_dir=directory, settings=settings,
                             label=f"{label} step")
    except Exception as e:  # a profiler problem must not cost the user the optimization
        notes.append(f"{label} profile not written: {type(e).__name__}: {e}")
        return None


def _compare(before: Any, after: Any, directory: str, report: Any, notes: list[str]) -> None:
    """Report tables from the profiles, and the before/after comparison beside the traces."""
    from rewriter.profiling import compare

    if before is not None:
        report.top_ops_before = before.top(10)
    if after is not None:
        report.top_ops_after = after.top(10)
    if before is None or after is None:
        return
    try:
        compare(before, after, labels=("eager", "optimized")).save(directory)
    except Exception as e:
        notes.append(f"profile comparison not written: {type(e).__name__}: {e}")


def _profile_cmd(args: argparse.Namespace) -> int:
    """``rewriter profile``: one model's step, profiled, without optimizing."""
    from rewriter.profile.peaks import resolve_peaks
    from rewriter.profiling import ProfileSettings, profile_model

    out, started_at = os.path.abspath(args.out), time.time()
    _check_writable(out)
    peaks: Any = args.peaks  # auto/cached: resolved on the profiled device
    if args.peaks == "none":
        peaks = None
    elif args.peaks not in ("auto", "cached", "measure"):
        peaks = resolve_peaks(args.peaks)  # a bad name or file fails before anything is built
    job = _build(args)
    _say(f"profiling {args.steps} step(s) of {type(job.model).__name__} -> {out}")
    result = profile_model(job.model, job.inputs, training=args.train, loss_fn=job.loss_fn,
                           optimizer=job.optimizer, steps=args.steps, out_dir=out,
                           top_k=args.top_k, settings=ProfileSettings(wait=0, warmup=1), peaks=peaks)
    print(result.to_markdown(top_k=args.top_k))
    from rewriter.decide.memory import profile_memory
    view = profile_memory(job.model, job.inputs, training=args.train, loss_fn=job.loss_fn,
                          optimizer=job.optimizer, out_dir=out)
    print("\n" + (view.to_markdown() if view is not None else
                  "no memory view: this device's profiler gives no memory events"))
    print(f"wrote to {out}: {', '.join(_grouped(_files_under(out, since=started_at)))}")
    return 0


def _documented() -> list[str]:
    from rewriter.profile.peaks import DOCUMENTED
    return sorted(DOCUMENTED)


def _check_writable(directory: str) -> None:
    """Fail before any measuring when the results could not be written."""
    probe = os.path.join(directory, f".rewriter-write-test-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"output directory {directory} is not writable: {e.strerror or e}") from e


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def _to_device(model: nn.Module, inputs: tuple | dict, device: str | None
               ) -> tuple[nn.Module, tuple | dict]:
    if device is None:
        return model, inputs
    if device.partition(":")[0] == "npu":
        from rewriter.devices.backends import import_torch_npu
        if import_torch_npu() is None:  # registers the "npu" device type with torch
            raise ValueError(f"--device {device}: torch_npu does not import here")
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return model.to(device), torch.utils._pytree.tree_map(move, inputs)


def _step(run: nn.Module, job: _Job, optimizer: Any, dtype: Any) -> Callable[[], None]:
    """One step exactly as the gate runs it (same default loss: ``.loss`` or a fixed cotangent)."""
    from rewriter.decide.job import Job
    from rewriter.devices.backends import get_backend

    model = getattr(run, "original", run)
    backend = get_backend(next((t.device.type for t in model.parameters()), "cpu"))
    args_, kwargs_ = job.args_kwargs
    return Job(model, args_, kwargs_, backend, model.training, optimizer, job.loss_fn,
               dtype).step(run)


def _export_graphs(fast: nn.Module, job: _Job, directory: str) -> Any:
    """Write the graph code; a loadable module is loaded back and checked against ``fast``."""
    from rewriter.capture.graph_export import load_exported, write_graph_code
    from rewriter.decide.state import preserved_state

    export = write_graph_code(fast, directory)
    if export.loadable is None:
        return export
    args_, kwargs_ = job.args_kwargs
    try:
        with preserved_state(fast.original), torch.no_grad():
            rewritten = load_exported(export.loadable).load(fast.original)
            torch.manual_seed(0)
            got = rewritten(*args_, **kwargs_)
            torch.manual_seed(0)  # the same draws for dropout in a train-mode graph
            want = fast(*args_, **kwargs_)
        torch.testing.assert_close(got, want)
        export.note += "; loaded back and checked against the optimized model"
    except Exception as e:
        export.note += f"; loading it back FAILED ({type(e).__name__}: {str(e)[:200]})"
    return export


def _dump_aoe(fast: nn.Module, optimizer: Any, job: _Job, args: argparse.Namespace, report: Any,
              out: str) -> list[str]:
    """The last thing the process runs: AOE dumping, once on, stays on (host.dump_aoe_step)."""
    from rewriter.devices import host
    from rewriter.devices.backends import get_backend

    step = _step(fast, job, optimizer, _DTYPES[args.dtype] if args.dtype else None)
    _say(f"dumping one step for AOE into {args.aoe}")
    dump = host.dump_aoe_step(step, args.aoe, synchronize=get_backend(report.device).synchronize)
    lines = [f"AOE: one step dumped to {dump.directory}; tune its operators (static shapes "
             f"only) with:\n    {dump.command}"]
    if report.device != "npu":
        lines.append(f"AOE: the model ran on {report.device}; AOE tunes NPU operators")
    report.notes += [f"host: {line}" for line in lines]
    report.save(out)
    return lines


def _files_under(directory: str, since: float) -> list[str]:
    """Files under ``directory`` written at ``since`` or later, relative to it."""
    paths = (os.path.join(d, f) for d, _, names in os.walk(directory) for f in names)
    return sorted(os.path.relpath(p, directory) for p in paths if os.path.getmtime(p) >= since - 1)


def _summary(report: Any, out: str, written: list[str], host_lines: list[str], seconds: float) -> str:
    """The closing table: one row per pass tried, then the verdict and where things went."""
    rows = [("pass", "decision", "speedup", "sites", "reason")]
    for d in report.decisions:
        speed = f"{d.speedup:.3f}x ±{d.noise:.3f}" if d.speedup is not None and d.noise is not None else "-"
        reason = d.reason if len(d.reason) <= 70 else d.reason[:67] + "..."
        rows.append((d.pass_name, d.status, speed, str(len(d.sites)), reason))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"rewriter optimize: {report.model}, {report.mode} on {report.device}, front-end "
             f"{report.front_end or 'none'}, {report.graphs} graph(s); optimize() "
             f"{report.optimize_seconds:.1f} s, whole run {seconds:.1f} s", ""]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    verdict = "optimized model" if report.final.get("kept") else "original model"
    lines += ["", f"  whole model: {verdict}: {report.final.get('reason', '')}",
              f"  kept: {', '.join(report.kept_passes) or 'nothing'}"]
    if report.plan_status:
        lines.append(f"  plan: {report.plan_status}")
    lines += [f"  host: {line}" for line in host_lines]
    lines.append(f"  wrote to {out}: {', '.join(_grouped(written))}")
    return "\n".join(lines)


def _grouped(paths: list[str]) -> list[str]:
    """Top-level files by name; a folder's files as ``folder/ (N files)`` past three of them."""
    by_top: dict[str, list[str]] = {}
    for p in paths:
        by_top.setdefault(p.split(os.sep)[0] if os.sep in p else p, []).append(p)
    shown = []
    for top, files in by_top.items():
        shown += files if len(files) <= 3 else [f"{top}/ ({len(files)} files)"]
    return shown


# --- entry point ---------------------------------------------------------------------------

def _add_model_options(p: argparse.ArgumentParser) -> None:
    """What builds and runs the model: shared by ``optimize`` and ``profile``."""
    p.add_argument("spec", metavar="SPEC", help="package.module:factory or path/to/file.py:factory")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the results")
    p.add_argument("--train", action="store_true", help="the training step (forward, backward, "
                   "optimizer step); default: inference")
    p.add_argument("--loss", metavar="SPEC", help="module:function or file.py:function, "
                   "loss_fn(output) -> scalar (default: output.loss, else a fixed cotangent)")
    p.add_argument("--optimizer", choices=sorted(_OPTIMIZERS) + ["none"], default="adamw",
                   help="optimizer of the training step (default: adamw)")
    p.add_argument("--input", action="append", default=[], metavar="[NAME=]DIMS[:DTYPE]",
                   help="an example input when the factory returns only the model, e.g. 4x256 "
                        "or input_ids=2x128:int64 (repeat for several)")
    p.add_argument("--device", help="cpu, cuda[:i] or npu[:i]: move the model and inputs there "
                   "(default: where the factory put them)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rewriter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="optimize the built-in example and print the report")
    demo.add_argument("--out", help="also write report.json, report.md and plan.json here")
    demo.add_argument("--generate", action="store_true",
                      help="serve a small causal LM instead (needs transformers): optimize() "
                           "decides prefill and decode, then greedy generate(), tokens/s")
    demo.set_defaults(run=_demo)

    opt = sub.add_parser("optimize", help="optimize a model from a factory; write plan, report, "
                                          "traces and graph code")
    _add_model_options(opt)
    opt.add_argument("--dtype", choices=sorted(_DTYPES), help="allow precision-lowering rewrites "
                     "to this dtype (default: keep fp32 numerics)")
    opt.add_argument("--plan", metavar="PLAN", help="replay this plan.json without measuring")
    opt.add_argument("--cache-dir", metavar="DIR", help="decision cache: replay the plan made "
                     "before for the same graphs, shapes and device, else measure and store it")
    opt.add_argument("--passes", metavar="NAMES", help="comma-separated passes to try (default: all)")
    opt.add_argument("--exclude", metavar="NAMES", help="comma-separated passes not to try")
    opt.add_argument("--front-end", choices=("auto", "fx", "dynamo"), default="auto",
                     help="capture with symbolic_trace (fx), a Dynamo backend, or the first that "
                          "captures the whole model (auto, the default)")
    opt.add_argument("--compile", choices=sorted(_COMPILE) + ["inductor", "npugraph_ex", "npugraphs",
                                                               "torchair"], default="auto",
                     help="the graph compiler as a gated candidate after the rewrites: auto (where "
                          "its predicted cost repays within a tenth of --steps; the default), on, "
                          "off, or one executor")
    opt.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                     help="steps (or calls) the run will make; a compile is paid where predicted "
                          "to repay within a tenth of them, kept where it repays within them "
                          "(default: 1000 for --compile auto)")
    opt.add_argument("--min-speedup", type=float, default=1.03, metavar="RATIO",
                     help="keep a rewrite only at least this much faster (default 1.03)")
    opt.add_argument("--objective", choices=("time", "memory"), default="time",
                     help="time (default): keep what is faster; memory: also keep what lowers "
                          "the step's peak memory within --memory-slowdown")
    opt.add_argument("--memory-slowdown", type=float, default=0.03, metavar="SHARE",
                     help="with --objective memory: the slowdown accepted for a memory saving "
                          "(default 0.03)")
    opt.add_argument("--budget", type=float, metavar="SECONDS",
                     help="measuring time per comparison (default 4)")
    opt.add_argument("--no-traces", action="store_true", help="skip profiling the eager and "
                     "optimized steps (no traces/, no operator tables in the report)")
    opt.add_argument("--bind-cores", action="store_true", help="bind this process to the CPUs "
                     "of the device's NUMA node (tuning guide: 绑核)")
    opt.add_argument("--aoe", metavar="DIR", help="Ascend NPU: dump one step of the optimized "
                     "model for AOE operator tuning into DIR and print the aoe command")
    opt.set_defaults(run=_optimize)

    prof = sub.add_parser("profile", help="profile a model's step from a factory (no rewriting): "
                                          "trace, TensorBoard, operator table and chart")
    _add_model_options(prof)
    prof.add_argument("--steps", type=int, default=2, help="profiled steps (default 2)")
    prof.add_argument("--top-k", type=int, default=15, help="operators in the table (default 15)")
    prof.add_argument("--peaks", default="auto", metavar="auto|measure|cached|none|DEVICE|FILE.json",
                      help="the roofline's peaks: auto (this machine's, measured once by a GEMM and "
                           "copy micro-benchmark and cached; REWRITER_CACHE_DIR or ~/.cache/rewriter), "
                           "measure (again, replacing the cache), cached (only a cached measurement), "
                           "none, a documented device (" +
                           ", ".join(_documented()) + ") or a JSON file {device, gflops: {dtype: "
                           "GFLOP/s}, gb_per_s, source}")
    prof.set_defaults(run=_profile_cmd)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2: bad input, with the reason on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        with _progress_shown():
            return args.run(args)
    except ValueError as e:  # bad input: SPEC, plan, output directory, options (PlanError too)
        print(f"rewriter {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
