"""Capture a model as fx graphs, with two front-ends behind one interface.

* ``fx``: ``torch.fx.symbolic_trace`` for models that trace whole. One GraphModule with readable
  code that the offline script can write out. Chosen when tracing succeeds and no module has
  hooks (a traced graph would silently drop them).
* ``dynamo``: ``torch.compile(model, backend=<ours>)``. Dynamo hands each captured graph to our
  backend; graph breaks are fine, Python control flow stays in Python. transformers v5 models
  need this: they no longer trace with ``symbolic_trace``.

Each captured graph lives in a :class:`GraphSlot` that holds the kept version and, while the
gate is deciding, a candidate. One :class:`Switch` per capture flips every slot between the two,
so the gate measures the *whole* step with and without a rewrite and nothing recompiles.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.fx import GraphModule

from rewriter.capture import code_entries
from rewriter.capture.ir import (
    annotate_tensor_info,
    copy_graph_module,
    fill_missing_info,
    functionalize_leaf_modules,
)
from rewriter.decide.verify import dropout_disabled
from rewriter.errors import CaptureError
from rewriter.pass_api import Pass, PassContext, Site

log = logging.getLogger(__name__)


@dataclass
class Switch:
    """Which variant every slot of one capture runs."""

    use_candidate: bool = False
    deterministic: bool = False  # dropout off, for the numerics check
    use_compiled: bool = False  # regional compile: the graphs run their compiled form


class GraphSlot:
    """One captured graph: the original, the kept rewrite of it, and a candidate under test.

    ``overlay`` (the precision pass, once kept) is applied on top of whatever runs: the slot
    runs ``overlay(kept)``, or ``overlay(candidate)`` while a candidate is measured, so every
    later decision is measured in the precision the model will run in. ``recorder``, when set,
    records boundary values in the next run of the kept graph (rewriter.capture.record).
    """

    def __init__(self, gm: GraphModule, switch: Switch, name: str) -> None:
        self.original = gm
        self.kept = gm
        self.kept_run = gm  # overlay(kept): what the optimized model runs
        self.candidate: GraphModule | None = None
        self.candidate_run: GraphModule | None = None
        self.compiled: Callable[..., Any] | None = None  # kept_run, compiled (wrapper.compile)
        self.overlay: Callable[[GraphModule], GraphModule] | None = None
        self.recorder: Any = None
        self.switch = switch
        self.name = name
        self.calls = 1  # runs per model call (regional capture: as counted, see counting_calls)
        self.block: str | None = None  # the block class whose forward this graph is
        self.runs = 0
        # regional compile: the backend that compiles kept_run (or compile_source) at its first
        # run with switch.use_compiled, and what it gave (one compile serves every instance of
        # a block)
        self.compiler: Callable[..., Any] | None = None
        self.compiled_form: Callable[..., Any] | None = None
        # what the compiler gets instead of kept_run (a compile candidate with some kept
        # rewrites set aside, rewriter.decide.compile_gate); None: kept_run
        self.compile_source: GraphModule | None = None

    @property
    def rewritten(self) -> bool:
        """Whether this graph runs with a kept rewrite (its own graph or a precision overlay)."""
        return self.kept is not self.original or self.overlay is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.runs += 1
        if self.switch.use_candidate and self.candidate_run is not None:
            gm = self.candidate_run
        elif self.recorder is not None:
            recorder, self.recorder = self.recorder, None
            with dropout_disabled() if self.switch.deterministic else contextlib.nullcontext():
                return recorder.run(self.kept_run, args, kwargs)
        else:
            gm = self.compiled if self.compiled is not None else self.kept_run
            if self.switch.use_compiled and self.compiler is not None:
                if self.compiled_form is None:
                    source = self.compile_source if self.compile_source is not None else self.kept_run
                    self.compiled_form = self.compiler(source, list(args))
                gm = self.compiled_form
        if self.switch.deterministic:
            with dropout_disabled():
                return gm(*args, **kwargs)
        return gm(*args, **kwargs)

    def _run_form(self, gm: GraphModule) -> GraphModule:
        return self.overlay(gm) if self.overlay is not None else gm

    def try_pass(self, p: Pass, ctx: PassContext) -> list[Site]:
        """Build a candidate with ``p`` applied to the kept graph; return the sites it rewrote."""
        gm = copy_graph_module(self.kept)
        sites = p.find(gm, ctx)
        if sites:
            p.apply(gm, sites, ctx)
            finish_rewrite(gm)
            self.set_candidate(gm)
        else:
            self.set_candidate(None)
        return sites

    def set_candidate(self, gm: GraphModule | None) -> None:
        self.candidate = gm
        self.candidate_run = self._run_form(gm) if gm is not None else None

    def set_kept(self, gm: GraphModule) -> None:
        self.kept = gm
        self.kept_run = self._run_form(gm)
        self.candidate = self.candidate_run = None

    def set_overlay(self, overlay: Callable[[GraphModule], GraphModule] | None) -> None:
        self.overlay = overlay
        self.kept_run = self._run_form(self.kept)

    def accept(self) -> None:
        if self.candidate is not None:
            self.kept, self.kept_run = self.candidate, self.candidate_run or self.candidate
        self.candidate = self.candidate_run = None

    def reject(self) -> None:
        self.candidate = self.candidate_run = None


def finish_rewrite(gm: GraphModule) -> None:
    """After a pass changed ``gm``: check it, regenerate its code, give new nodes their facts."""
    gm.graph.lint()
    gm.recompile()
    fill_missing_info(gm)  # later passes read the facts of the nodes this one made


class Capture:
    """A captured model: call it like the model; its slots are what passes rewrite."""

    front_end: str = ""
    dynamic_lengths = False  # traced dynamic in every length from the first call (DynamoCapture)
    nests = False  # the original model compiled whole nests its repeated blocks (RegionalCapture)

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.switch = Switch()
        self.slots: list[GraphSlot] = []
        self.left_as_modules: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def graph_code(self) -> dict[str, str]:
        """Python code of each graph as it runs, by slot name."""
        return {s.name: s.kept_run.code for s in self.slots}


class FxCapture(Capture):
    """A whole-model ``symbolic_trace``: one slot, one GraphModule sharing the model's tensors."""

    front_end = "fx"

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, reason: str) -> None:
        super().__init__(reason)
        traced = torch.fx.symbolic_trace(model)
        gm = GraphModule(model, traced.graph, class_name=f"{type(model).__name__}Graph")
        self.left_as_modules = functionalize_leaf_modules(gm)
        gm = GraphModule(model, gm.graph, class_name=f"{type(model).__name__}Graph")
        with torch.no_grad():
            annotate_tensor_info(gm, args, kwargs)
        self.training = model.training
        self.output_type: type | None = None
        self.slots.append(GraphSlot(gm, self.switch, "graph_0"))

    def restore_output_type(self, output_type: type | None) -> None:
        """symbolic_trace returns a dict-subclass output (transformers' ModelOutput) as a plain
        dict: rebuild the model's own type so ``out.logits`` keeps working."""
        if output_type is not None and output_type is not dict and issubclass(output_type, dict):
            self.output_type = output_type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.slots[0](*args, **kwargs)
        if self.output_type is not None and type(out) is dict:
            return self.output_type(**out)
        return out


# Entries one code object may hold while our captures run it: library frames (transformers'
# forward wrapper, its mask functions) are compiled once per live optimized model and signature,
# and Dynamo's default limit (8) would leave the ninth uncaptured (rewriter.capture.code_entries).
CAPTURE_SIGNATURES = 64


class DynamoCapture(Capture):
    """``torch.compile`` with our backend; a slot per graph Dynamo hands over.

    Graphs compiled after ``optimize()`` has decided (a new input shape, train/eval switched)
    get the kept passes applied without measuring, through ``on_new_graph``.
    """

    front_end = "dynamo"

    def __init__(self, model: nn.Module, reason: str,
                 then_compile: Callable[[GraphModule, list[Any]], Callable[..., Any]] | None = None,
                 dynamic_lengths: bool = False) -> None:
        """``then_compile``: a torch.compile backend that each rewritten graph is handed to
        (after ``on_new_graph``); by default the graphs run as they are. ``dynamic_lengths``:
        Dynamo traces every size symbolic from the first call (``dynamic=True``; a size that
        meets a weight's, and sizes 0 and 1, are still specialized), so a prompt's length and
        a KV cache's are dynamic at once, not after a second length; the modules' float
        attributes stay constants."""
        super().__init__(reason)
        self.dynamic_lengths = dynamic_lengths
        code_entries.release_unowned()  # before this capture compiles anything
        self.on_new_graph: Callable[[GraphSlot], None] | None = None
        self.then_compile = then_compile
        self._model_tensors = {id(t) for t in list(model.parameters()) + list(model.buffers())}
        # torch's own torch.compile: importing Lightning replaces it with a wrapper that writes
        # ``_compile_kwargs`` onto the compiled module, i.e. onto the user's model (and Fabric
        # would then take the model for one the user compiled).
        plain_compile = inspect.unwrap(torch.compile)
        self.compiled = plain_compile(model, backend=_weak_backend(self, None),
                                      dynamic=True if dynamic_lengths else None)
        self._ignored_logging = _once_logging_functions()  # once: __call__ runs every step
        self._dynamo_patches: dict[int, Any] = {}  # recompile_limit -> a reusable config patch

    def _backend(self, gm: GraphModule, example_inputs: list[Any], block: Any = None) -> Callable[..., Any]:
        self.left_as_modules += functionalize_leaf_modules(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, example_inputs):
            if isinstance(value, torch.Tensor) and id(value) in self._model_tensors:
                node.meta["model_tensor"] = True  # a parameter or buffer (each instance's own)
                if self._same_in_every_instance(value, block):
                    node.meta["static_value"] = value  # the model's own tensor, by reference
        # The outer graphs are graph_0, graph_1, ...; a block's are Class.graph_0, ...
        prefix = "" if block is None else f"{block.name}."
        name = prefix + f"graph_{sum(s.block == getattr(block, 'name', None) for s in self.slots)}"
        slot = GraphSlot(gm, self.switch, name)
        if block is not None:
            slot.block, slot.calls = block.name, block.calls
        slot.compiler = getattr(self, "graph_compiler", None)  # regional compile: every graph
        self.slots.append(slot)
        log.debug("dynamo handed over %s with %d nodes", slot.name, len(gm.graph.nodes))
        if self.on_new_graph is not None:
            self.on_new_graph(slot)
        if self.then_compile is not None:
            return self.then_compile(slot.kept_run, example_inputs)
        return slot

    def _same_in_every_instance(self, value: torch.Tensor, block: Any) -> bool:
        """Whole-model graphs: always. A block's graph serves every instance, so passes may read
        a tensor's value (a causal mask, a constant scale) only where it is the same in all."""
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        limit = max(torch._dynamo.config.recompile_limit, CAPTURE_SIGNATURES)
        with self.dynamo_settings(recompile_limit=limit), \
                _unlogged_trace_headers_skipped(), code_entries.calling(self):
            return self.compiled(*args, **kwargs)

    @contextlib.contextmanager
    def counting_calls(self) -> Iterator[None]:
        """Count how often each graph runs in the body (one step of the model). Regional: a
        block's graph runs once per instance that takes its signature (the first block's input
        may not need a gradient where the others' do; a checkpoint's recompute is a graph of its
        own), and the graph between two blocks once per gap; a generation's decode graphs once
        per decode call, and a graph only a warm-up ran, never. The counts weigh each site's
        saving."""
        for s in self.slots:
            s.runs = 0
        yield
        for s in self.slots:
            s.calls = s.runs

    def dynamo_settings(self, recompile_limit: int) -> Any:
        """``torch._dynamo.config.patch`` of the settings our calls run Dynamo with, made once
        per limit and entered at every call: torch's ``patch()`` defines a class each time it is
        called, and a generation calls the blocks' graphs dozens of times a step (3 layers,
        prefill and 8 decode calls: ~1.6 of the 7.8 ms a step the installed graphs cost over the
        original on a 2-core Xeon). Reused only where torch keeps a patch's saved values per
        context (a ContextVar, torch 2.13), so one patch object may be entered again, nested,
        or from another thread; an older torch gets a new one per call."""
        return kept_if_reusable(self._dynamo_patches, recompile_limit,
                                lambda: self._make_settings(recompile_limit))

    def _make_settings(self, recompile_limit: int) -> Any:
        settings = dict(ignore_logging_functions=self._ignored_logging, recompile_limit=recompile_limit)
        return dynamic_length_settings(**settings) if self.dynamic_lengths \
            else torch._dynamo.config.patch(**settings)


def reusable_patch(patch: Any) -> bool:
    """Whether a ``torch._dynamo.config.patch`` object (or :class:`Patches` of them) may be
    entered again, nested or from another thread: torch keeps its saved values in a ContextVar
    (2.13); an older torch keeps them on the object, and each entry needs a patch of its own."""
    if isinstance(patch, Patches):
        return all(reusable_patch(p) for p in patch.patches)
    return isinstance(getattr(patch, "_prior", None), contextvars.ContextVar)


def kept_if_reusable(cache: dict, key: Any, make: Callable[[], Any]) -> Any:
    """The patch ``cache`` keeps under ``key``, else ``make()``'s, kept there for the next call
    where torch allows entering it again (:func:`reusable_patch`); else a new one each time."""
    patch = cache.get(key)
    if patch is not None:
        return patch
    patch = make()
    if reusable_patch(patch):
        cache[key] = patch
    return patch


class Patches:
    """Config patches (torch's ``config.patch`` objects) entered and left as one."""

    def __init__(self, patches: list[Any]) -> None:
        self.patches = patches

    def __enter__(self) -> None:
        for p in self.patches:
            p.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for p in reversed(self.patches):
            p.__exit__(*exc)


def dynamic_length_settings(**dynamo: Any) -> Patches:
    """The settings a trace dynamic in its lengths (``dynamic=True``) runs under, with Dynamo's
    ``dynamo`` settings: the modules' float attributes as constants (traced as symbols,
    Inductor had Dynamo trace the whole model again), and no duck sizing: by default sizes of
    one value share one symbol at a trace's start, so a prompt as long as the head size (64,
    a common length) would share the head size's symbol and be fixed with it when a weight
    pins it, leaving a graph static in the prompt's length."""
    patches = [torch._dynamo.config.patch(specialize_float=True, **dynamo)]
    fx_config = getattr(torch.fx.experimental, "_config", None)
    if fx_config is not None and hasattr(fx_config, "use_duck_shape"):
        patches.append(fx_config.patch(use_duck_shape=False))
    return Patches(patches)


def _weak_backend(cap: "DynamoCapture", block: Any) -> Callable[[GraphModule, list[Any]], Callable[..., Any]]:
    """The capture's Dynamo backend, holding the capture weakly: Dynamo keeps every backend it
    was given until ``torch._dynamo.reset()``, and a capture kept alive that way would keep its
    model (and a regional capture's installed classes) alive with it."""
    ref = weakref.ref(cap)

    def backend(gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        owner = ref()
        if owner is None:  # the capture is gone: run what Dynamo traced, unrewritten
            return gm
        return owner._backend(gm, example_inputs, block)
    return backend


@contextlib.contextmanager
def _unlogged_trace_headers_skipped() -> Iterator[None]:
    """Dynamo writes a "file:line in function" header for every node it records, for a debug
    log (``TORCH_LOGS=trace_call``) whether or not that log is on, and naming the function
    tokenizes each source file it traces once per process: about 1 s of the first capture of
    a transformers model on a 2-core AMD EPYC (4.6 -> 3.6 s, LLaMA, 4 layers; two processes
    each way, not side by side). With the logs that print the header off, the function name is
    left out of it; with them on, nothing changes. (In torch 2.13 the header feeds only those
    logs; graph-break messages name frames otherwise.)"""
    try:
        import torch._dynamo.symbolic_convert as sc
    except ImportError:  # pragma: no cover - a torch without this module
        yield
        return
    logs = [getattr(sc, name, None) for name in ("trace_call_log", "trace_source_log")]
    current = getattr(sc, "get_funcname", None)
    if not callable(current) or current is _no_funcname or \
            any(lg is None or lg.isEnabledFor(logging.DEBUG) for lg in logs):
        yield  # (already skipped by a call in flight: that call puts the real one back)
        return
    sc.get_funcname = _no_funcname
    try:
        yield
    finally:
        sc.get_funcname = current


def _no_funcname(filename: str, lineno: int) -> None:
    return None


def _once_logging_functions() -> set[Callable[..., Any]]:
    """Logger methods Dynamo may drop while tracing: transformers' ``warning_once`` and
    ``info_once``. Each is a graph break otherwise, and a break deep inside forward makes Dynamo
    trace the model again from each frame above it (GPT-2's loss: 10 s instead of 4, and the
    loss left outside the graph). Dropping them changes nothing the user sees: a message logged
    once was already logged by the eager reference run, the first call optimize() makes."""
    return {f for f in (getattr(logging.Logger, name, None) for name in ("warning_once", "info_once"))
            if f is not None} | torch._dynamo.config.ignore_logging_functions


def _hooked_modules(model: nn.Module) -> list[str]:
    hooked = []
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or getattr(m, "_backward_hooks", None):
            hooked.append(name or "<root>")
    return hooked


def capture(model: nn.Module, args: tuple, kwargs: dict, front_end: str = "auto") -> Capture:
    """Capture ``model`` with the front-end asked for, or the best one that works ("auto")."""
    if front_end not in ("auto", "fx", "dynamo"):
        raise ValueError(f"front_end must be 'auto', 'fx' or 'dynamo', got {front_end!r}")
    if front_end == "dynamo":
        return DynamoCapture(model, "asked for (front_end='dynamo')")
    hooked = _hooked_modules(model)
    if hooked and front_end == "auto":
        return DynamoCapture(model, f"modules with hooks ({', '.join(hooked[:3])}); "
                                    "symbolic_trace would drop them")
    if hooked:  # front_end="fx" asked for explicitly
        warnings.warn(f"rewriter: front_end='fx' drops the hooks on {', '.join(hooked[:3])}: "
                      "symbolic_trace inlines those modules, so their hooks will not run in the "
                      "optimized model (front_end='auto' or 'dynamo' keeps them)", stacklevel=4)
    try:
        return FxCapture(model, args, kwargs, "symbolic_trace captured the whole model")
    except Exception as e:  # symbolic_trace fails in many ways on real models
        if front_end == "fx":
            raise CaptureError(f"torch.fx.symbolic_trace failed on {type(model).__name__}: {e}") from e
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return DynamoCapture(model, f"symbolic_trace failed ({type(e).__name__}: {first_line[:160]})")
