"""Executors: the device's graph compilers, as candidates the gate measures like a rewrite.

After the rewrites are decided, ``optimize(compile=...)`` hands the rewritten graphs to a
torch.compile backend and keeps the compiled form only when the whole step measures faster
(rewriter.decide.compile_gate). This module says which backends a device has and builds the compiled
runner of a capture::

    found, declined = executors_for(backend, choice=True)   # [Executor], ["name: why not"]
    runner = compiled_runner(job.model, capture, found[0].backend, on_new_graph)

Per device (``../shared/reference/npu_ecosystem.md`` §6 for the NPU):

* CPU: ``inductor`` (C++/OpenMP code generation; needs a C++ compiler).
* CUDA: ``inductor`` (Triton kernels; needs ``triton``).
* NPU (torch.compile is supported from TorchNPU 7.3.0): ``inductor`` with triton-ascend
  (needs ``triton`` importable), ``npugraph_ex`` and ``npugraphs`` (ACLGraph capture; fixed
  shapes, which the gate's example inputs are; registered by torch_npu on import) and
  TorchAir-GE (``torchair.get_npu_backend()``, imported after torch_npu; inference-oriented, so
  it is tried for inference only). Each is import-guarded and tried only where it is
  available; otherwise it is declined with the reason. Written to torch_npu's documented API
  and tested against ``tests/npu_shim.py`` with monkeypatched imports (no NPU here).

``choice``: True (the device's executors), a backend name (``"inductor"``, ``"npugraphs"``,
...) or a torch.compile backend callable ``(gm, example_inputs) -> callable`` (tests inject
a fake compiler this way).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from rewriter.capture.front_ends import (Capture, DynamoCapture, FxCapture, GraphSlot,
                                         dynamic_length_settings, kept_if_reusable)
from rewriter.capture.regional import RegionalCapture
from rewriter.decide.generation import forward_in_place, is_decode_call
from rewriter.decide.job import switched
from rewriter.decide.verify import dropout_disabled
from rewriter.devices.compiled_loss import CACHEABLE, with_compiled_losses
from rewriter.devices.dynamo_inputs import as_dynamo_hands_it
from rewriter.devices.inductor_fixes import with_inductor_fixes
from rewriter.devices.kernel_batches import with_kernel_batches
from rewriter.devices.npu_capabilities import torch_npu_release

CompilerBackend = Callable[..., Any]  # torch.compile's backend protocol: (gm, example_inputs) -> callable

# The first TorchNPU release whose docs support torch.compile (npu_ecosystem.md §6).
NPU_COMPILE_RELEASE = (7, 3, 0)


@dataclass(frozen=True)
class Executor:
    """One graph compiler: ``backend`` is what ``torch.compile(backend=...)`` takes."""

    name: str
    backend: str | CompilerBackend
    inference_only: bool = False
    kernel_batches: bool = False  # Inductor's CPU kernels built a few to a program
    codegen_fixes: bool = False  # Inductor's CPU miscompiles fixed (rewriter.devices.inductor_fixes)

    def resolve(self) -> CompilerBackend:
        """The backend callable (a name is looked up in torch._dynamo's registry)."""
        fn = torch._dynamo.lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        if self.codegen_fixes:
            fn = with_inductor_fixes(fn)
        return with_kernel_batches(fn) if self.kernel_batches else fn


def executors_for(backend: Any, choice: bool | str | CompilerBackend = True,
                  training: bool = True) -> tuple[list[Executor], list[str]]:
    """The executors to try on ``backend`` (a rewriter Backend) and, for each one not tried,
    ``"name: why"``. ``choice`` narrows the list (see the module docstring)."""
    if callable(choice) and not isinstance(choice, str):
        name = getattr(choice, "__name__", type(choice).__name__)
        return [Executor(name, choice)], []
    found: list[Executor] = []
    declined: list[str] = []
    for name, check in _CHECKS.get(backend.name, ()):
        if isinstance(choice, str) and choice != name:
            continue
        problem = check(training)
        if problem is None:
            ex = _EXECUTORS[name]()
            found.append(replace(ex, kernel_batches=(backend.name, name) in KERNEL_BATCHES,
                                 codegen_fixes=(backend.name, name) in CODEGEN_FIXES))
        else:
            declined.append(f"{name}: {problem}")
    if isinstance(choice, str) and not found and not declined:
        known = [n for n, _ in _CHECKS.get(backend.name, ())]
        raise ValueError(f"compile={choice!r}: no such executor on {backend.name} (it has {known})")
    return found, declined


# --- availability checks: None, or why not -------------------------------------------------------
def _cpu_inductor(training: bool) -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:  # no g++/clang: Inductor's C++ backend cannot build kernels
        return f"no C++ compiler for Inductor's CPU code ({type(e).__name__}: {e})"
    return None


def _cuda_inductor(training: bool) -> str | None:
    from torch.utils._triton import has_triton
    return None if has_triton() else "triton is not installed (Inductor's CUDA kernels need it)"


def _torch_npu() -> Any | None:
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError):
        return None


def _npu_compile_problem() -> str | None:
    mod = _torch_npu()
    if mod is None:
        return "torch_npu does not import here"
    version = str(getattr(mod, "__version__", ""))
    release = torch_npu_release(version)
    if _release_tuple(release) < NPU_COMPILE_RELEASE:
        return (f"torch_npu {version} (TorchNPU {release or 'unknown'}) predates torch.compile "
                "support on NPU (TorchNPU 7.3.0)")
    return None


def _release_tuple(release: str | None) -> tuple[int, int, int]:
    """``"7.3.0"`` -> (7, 3, 0); a release candidate ranks below its release (``6.0.rc3``:
    (6, 0, -1)); unknown: (0, 0, 0)."""
    m = re.match(r"(\d+)\.(\d+)\.(rc)?(\d+)", release or "")
    if m is None:
        return (0, 0, 0)
    return (int(m[1]), int(m[2]), -1 if m[3] else int(m[4]))


def _npu_inductor(training: bool) -> str | None:
    problem = _npu_compile_problem()
    if problem:
        return problem
    if importlib.util.find_spec("triton") is None:
        return "triton-ascend is not installed (Inductor's NPU code generation needs it)"
    return None


def _npu_registered(name: str) -> Callable[[bool], str | None]:
    def check(training: bool) -> str | None:
        problem = _npu_compile_problem()
        if problem:
            return problem
        if name not in torch._dynamo.list_backends(exclude_tags=()):
            return f"this torch_npu does not register the {name!r} torch.compile backend"
        return None
    return check


def _npu_torchair(training: bool) -> str | None:
    problem = _npu_compile_problem()
    if problem:
        return problem
    if training:
        return "TorchAir-GE is inference-oriented; not tried for a training step"
    try:
        importlib.import_module("torchair")  # after torch_npu (the docs' order)
    except (ImportError, RuntimeError, OSError) as e:
        return f"torchair does not import here ({type(e).__name__})"
    return None


def _torchair_backend() -> CompilerBackend:
    torchair = importlib.import_module("torchair")
    return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())


_CHECKS: dict[str, tuple[tuple[str, Callable[[bool], str | None]], ...]] = {
    "cpu": (("inductor", _cpu_inductor),),
    "cuda": (("inductor", _cuda_inductor),),
    "npu": (("inductor", _npu_inductor), ("npugraph_ex", _npu_registered("npugraph_ex")),
            ("npugraphs", _npu_registered("npugraphs")), ("torchair", _npu_torchair)),
}

# (device, executor) whose kernels are built a few to a program (rewriter.devices.kernel_batches):
# a cold BERT compile's first step 28.0 / 28.1 -> 21.6 / 21.3 s (2-core Xeon with AMX)
KERNEL_BATCHES = {("cpu", "inductor")}
# (device, executor) whose code generation takes rewriter.devices.inductor_fixes: Inductor's C++
# kernels (torch 2.13's 2D-tiled scatter-add wrote past a buffer: T5's regional compile crashed)
CODEGEN_FIXES = {("cpu", "inductor")}

_EXECUTORS: dict[str, Callable[[], Executor]] = {
    "inductor": lambda: Executor("inductor", "inductor"),
    "npugraph_ex": lambda: Executor("npugraph_ex", "npugraph_ex"),
    "npugraphs": lambda: Executor("npugraphs", "npugraphs"),
    "torchair": lambda: Executor("torchair", _LazyBackend(_torchair_backend), inference_only=True),
}


class _LazyBackend:
    """A backend built at its first use (torchair's needs its import, done only if tried)."""

    __name__ = "torchair"

    def __init__(self, make: Callable[[], CompilerBackend]) -> None:
        self.make, self.backend = make, None

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Any:
        if self.backend is None:
            self.backend = self.make()
        return self.backend(gm, example_inputs)


# --- compiled runners ----------------------------------------------------------------------------
class CompiledFx:
    """An fx capture's rewritten graph under ``torch.compile``; called like the model. The
    compile happens at the first call."""

    def __init__(self, cap: FxCapture, backend: CompilerBackend) -> None:
        self.cap = cap
        self.fn = torch.compile(cap.slots[0].kept_run, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        if self.cap.output_type is not None and type(out) is dict:
            return self.cap.output_type(**out)
        return out


def compiled_runner(model: nn.Module, cap: Capture | None, backend: CompilerBackend,
                    on_new_graph: Callable[[GraphSlot], None], generation: bool = False,
                    source: Callable[[GraphSlot], Any] | None = None,
                    set_aside: Sequence[str] = (), same_masks: bool = False) -> Callable[..., Any]:
    """``model`` as it runs after optimize() (``cap``; None: the original model), compiled.

    A Dynamo capture is captured again with the backend after our own: each graph Dynamo hands
    over gets the kept rewrites (``on_new_graph``), then goes to the compiler. An fx capture's
    graph is compiled as it is. ``generation``: the original model serves generate(), so its
    forward is compiled in place of the instance's own (:class:`CompiledForward`).
    ``source``/``set_aside``: a regional capture's graphs compiled are ``source(slot)``, built
    without the kept rewrites ``set_aside`` (:class:`RegionalCompiled`). ``same_masks``: the
    original model's dropout drawn with eager's random ops (rewriter.decide.same_masks)."""
    if cap is None:
        if generation:
            return CompiledForward(model, backend)
        backend = with_config(backend, **SAME_MASKS) if same_masks else backend
        return inspect.unwrap(torch.compile)(model, backend=backend)
    if isinstance(cap, RegionalCapture):
        return RegionalCompiled(cap, backend, source, set_aside)
    if isinstance(cap, DynamoCapture):
        runner = DynamoCapture(model, "compiled candidate", then_compile=backend)
        runner.on_new_graph = on_new_graph
        return runner
    if isinstance(cap, FxCapture):
        return CompiledFx(cap, backend)
    raise TypeError(f"cannot compile a {type(cap).__name__}")


class CompiledForward:
    """The model's decode calls compiled, dynamic in the cache's length, and the model's own
    forward put in their place for the length of a call; the prefill runs the forward as it is.
    The transformers recipe's form (``model.forward = torch.compile(model.forward)``), held by
    us, not left on the user's model, and with transformers' own choice of what to compile:
    generate()'s automatic compile runs the prefill uncompiled and compiles the calls it makes
    per token. ``generate()`` reaches it inside :meth:`in_place`; the model's own ``__call__``
    (its hooks) runs around it::

        runner = CompiledForward(model, backend)
        runner(input_ids)                       # a prefill: the model's own forward
        with runner.in_place():
            model.generate(prompt, max_new_tokens=32)   # each decode call compiled

    Why not the prefill: it runs once a request, and its graph, dynamic in the prompt's length,
    cost more to compile than the decode graph (Qwen2 3 layers, 2-core Xeon: 15.2 s against
    8.6 s) for 1.2x on a call that is a small part of a generation. A decode call is one new
    token (:func:`is_decode_call`); ``dynamic=True``: one graph whatever the cache's length
    (Dynamo specializes sizes 0 and 1 only), with the module's float attributes (epsilons,
    scales) as constants: Dynamo would otherwise trace them as symbols and trace the whole
    model again when Inductor cannot keep them symbolic (a 6 s first attempt thrown away).
    The cache a prefill leaves is laid out as its projections were (heads before positions in
    memory), the one a decode call leaves is contiguous: each decode call gets the cache
    contiguous (:func:`contiguous_cache`), so the first decode call does not compile a graph
    of its own.
    """

    def __init__(self, model: nn.Module, backend: CompilerBackend) -> None:
        self.model = model
        eager = model.forward
        compiled = inspect.unwrap(torch.compile)(eager, backend=backend, dynamic=True)
        signature = inspect.signature(eager)

        # forward's own signature: generate() reads it to choose the arguments it passes
        @functools.wraps(eager)
        def fn(*args: Any, **kwargs: Any) -> Any:
            named = _as_keywords(signature, args, kwargs) if args else kwargs
            if named is None or not is_decode_call(named):
                return eager(*args, **kwargs)
            for value in named.values():
                contiguous_cache(value)
            with _decode_settings():
                return compiled(**named)
        self.fn = fn

    def in_place(self) -> contextlib.AbstractContextManager[None]:
        return forward_in_place(self.model, self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.in_place():
            return self.model(*args, **kwargs)


def _as_keywords(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict | None:
    """A call's arguments by name, as generate() passes them (a caller's own decode loop may
    pass the token ids positionally); None when they do not bind or forward takes ``*args``."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    named: dict = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            return None
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


_DECODE_SETTINGS: dict[str, Any] = {}  # the reusable patches, once made


def _decode_settings() -> Any:
    """The settings a decode call is traced with (:func:`dynamic_length_settings`): made once
    where torch allows entering them again, else anew for each call."""
    return kept_if_reusable(_DECODE_SETTINGS, "decode", dynamic_length_settings)


def contiguous_cache(cache: Any) -> None:
    """Make the keys and values of a transformers ``DynamicCache`` contiguous, in place of the
    layer's tensors (the same values; the cache's next ``torch.cat`` makes them contiguous
    anyway). Anything else, other cache layers included, is left as it is."""
    layer_cls = getattr(sys.modules.get("transformers.cache_utils"), "DynamicLayer", None)
    if layer_cls is None:
        return
    for layer in getattr(cache, "layers", None) or ():
        if type(layer) is not layer_cls:  # sliding-window and quantized layers keep their form
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel() and not t.is_contiguous():
                setattr(layer, name, t.contiguous())


class CompiledOriginal:
    """The original model compiled whole, beside a capture whose rewrites are kept: the
    candidate that hands the compiler the model's own code (a rewrite can hide a pattern from
    it). Under a regional capture each call runs with the installations lifted
    (:meth:`RegionalCapture.lifted`), so the trace sees every block's own code::

        runner = CompiledOriginal(model, cap, backend)
        runner(input_ids)          # the compiled original model; the rewritten one is untouched

    ``nest`` (Inductor): each repeated block's instances are one nested compile region
    (``RegionalCapture.lifted(nest=True)``), compiled once for all of them, with Inductor's
    buffer reuse off (:func:`without_buffer_reuse`). ``loss_forms`` (Inductor, training): each
    cross-entropy handed over in the form whose backward it writes in one pass, and a graph
    returning the logits its loss is made of cut after them
    (:mod:`rewriter.devices.compiled_loss`, :mod:`rewriter.devices.loss_cut`).
    """

    def __init__(self, model: nn.Module, cap: Capture | None, backend: CompilerBackend,
                 autocast: tuple[str, torch.dtype] | None = None, nest: bool = False,
                 same_masks: bool = False, loss_forms: bool = False) -> None:
        self.cap = cap if isinstance(cap, RegionalCapture) else None
        self.nest = bool(nest and self.cap is not None and self.cap.nests)
        patches = {**({"allow_buffer_reuse": False} if self.nest else {}),
                   **(SAME_MASKS if same_masks else {}),
                   **({"unsafe_marked_cacheable_functions": cacheable_with_losses()} if loss_forms else {})}
        if patches:
            backend = with_config(backend, **patches)
        if loss_forms:
            backend = with_compiled_losses(backend)
        self.fn = inspect.unwrap(torch.compile)(model, backend=backend)
        # (device type, dtype): the precision the rewrites set (cast_to_half), as autocast
        self.autocast = autocast

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            if self.cap is not None and not self.cap.lifted_for_good:
                stack.enter_context(self.cap.lifted(self.nest))
            if self.autocast is not None:
                stack.enter_context(torch.autocast(self.autocast[0], dtype=self.autocast[1]))
            return self.fn(*args, **kwargs)


# Inductor draws dropout with eager's random ops, so a compile is verified with dropout on
# (rewriter.decide.same_masks)
SAME_MASKS = {"fallback_random": True}


def cacheable_with_losses() -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` as set, and the compiled loss's entry."""
    import torch._inductor.config as inductor_config
    return {**inductor_config.unsafe_marked_cacheable_functions, **CACHEABLE}


def without_buffer_reuse(inductor: CompilerBackend) -> CompilerBackend:
    """Inductor, its buffer reuse off (forward and backward). With a nested compile region
    called for several instances, torch 2.13's Inductor reused a buffer one call's backward
    still needed: LLaMA and GPT-2, 2 layers, fp32 training, CPU, the gradients off by up to
    ~5000x their size (GPT-2 also in bf16 at 4 layers); right with reuse off, and the steps
    level with the whole model compiled (bf16, 4 layers, interleaved: GPT-2 0.996x, LLaMA
    1.009x; README). The compiled form is verified like any other all the same."""
    return with_config(inductor, allow_buffer_reuse=False)


def with_config(inductor: CompilerBackend, **patches: Any) -> CompilerBackend:
    """Inductor with ``torch._inductor.config`` patched for its compiles (forward and backward)."""
    def compile_graph(gm: Any, example_inputs: Any) -> Any:
        return inductor(gm, example_inputs, config_patches=patches)
    compile_graph.__name__ = getattr(inductor, "__name__", "inductor")
    return compile_graph


class RegionalCompiled:
    """Regional compile: each block graph compiled once for all its instances, each graph
    around the blocks (embeddings, the mask, the head and the loss) once, each at its first
    compiled run. The cost does not grow with depth; the graphs around the blocks cost one
    compile each, and they hold what the compiler fuses in some models: BERT training (4
    layers, fp32, 2-core Xeon without AMX, cold processes, `.diag`-style runs of optimize(
    steps=20000)): blocks only 0.980x over the rewritten eager step, rejected; every graph
    1.054x, kept, first compiled step 12.4 -> 14.3 s (the MLM head's softmax over 8000 words
    and its backward fused). While it runs, the graphs run compiled; once it is kept, they do
    so at every call. The graphs go to the backend as Dynamo would hand them over (fake inputs
    of a fake mode with a ShapeEnv), so Inductor's and AOTAutograd's caches keep them for a
    later process (:mod:`rewriter.devices.dynamo_inputs`).
    """

    def __init__(self, cap: RegionalCapture, backend: CompilerBackend,
                 source: Callable[[GraphSlot], Any] | None = None, set_aside: Sequence[str] = ()) -> None:
        self.cap, self.backend, self.source = cap, as_dynamo_hands_it(backend), source
        self.set_aside = tuple(set_aside)  # kept rewrites the compiled graphs are built without
        cap.compile_graphs(self.backend, source)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with switched(self.cap.switch, use_compiled=True):
            return self.cap(*args, **kwargs)

    def keep(self) -> None:
        """From now on the installed blocks run their compiled graphs, whoever calls them. The
        slots hold one executor's compiled forms at a time: where another executor was tried
        after this one (NPU offers several), this one's are compiled again, at their next run."""
        if self.cap.graph_compiler is not self.backend:
            self.cap.compile_graphs(self.backend, self.source)
        self.cap.switch.use_compiled = True


def has_dropout(cap: Capture | None, model: nn.Module) -> bool:
    """Whether a training step draws dropout masks (a compiled graph draws them its own way, so
    it is verified with dropout off, which compiles it once more)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    for slot in (cap.slots if cap is not None else []):
        for n in slot.original.graph.nodes:
            if n.op != "call_function":
                continue
            if n.target in dropout_disabled._DROPOUTS:
                p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
                if not isinstance(p, (int, float)) or p > 0:
                    return True
            if n.target is F.scaled_dot_product_attention:
                p = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
                if not isinstance(p, (int, float)) or p > 0:
                    return True
    return False
