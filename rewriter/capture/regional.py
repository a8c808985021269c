"""Regional capture: each repeated block class traced once, installed in every instance.

The model's repeated blocks (rewriter.capture.blocks) are the unit: Dynamo traces one instance's
forward, with the parameters as graph inputs, so the one graph it hands over serves every
instance of the class (a 32-layer model costs one block). The installed forward
(rewriter.capture.install) runs that graph for every registered instance behind the instance's own
call; the rest of the model is captured around the blocks as the outer graphs, in which each
block is a call. The pipeline decides on these graphs as on any capture's::

    cap = RegionalCapture(model, "why", find_blocks(model))
    cap(*args)              # the outer graphs and, in them, the block graphs ("Block.graph_0")
    cap.engage()            # after optimize(): every call of the model runs the block graphs
    cap.remove()            # the classes' forwards are what they were
"""
from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import types
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch._C._dynamo.eval_frame import reset_code
from torch._dynamo.eval_frame import skip_code

from rewriter.capture import code_entries
from rewriter.capture.blocks import unwrapped_class
from rewriter.capture.front_ends import DynamoCapture, _unlogged_trace_headers_skipped, _weak_backend
from rewriter.capture.install import FLAG, NESTED, hooks_of, install
from rewriter.decide.verify import FUNCTIONAL_DROPOUTS, dropout_modules, dropout_modules_off


EAGER = object()  # a compile source's answer for a graph that stays as it runs, uncompiled


class RegionalCapture(DynamoCapture):
    """Regional capture: each repeated block class traced once, its graphs installed in every
    instance (rewriter.capture.install), and the rest of the model captured around them as the outer
    graphs, in which each block is a call.

    Dynamo traces one instance's forward with the parameters as graph inputs, so the graph it
    hands over serves every instance of the class; a signature not seen yet (new shapes, the
    other train/eval mode, grad mode) is a new graph, to which the kept rewrites are replayed.
    A transformers cache passed to a block is shown to it as that block's own layer of the
    cache (``_LayerCache``), so writing the cache does not make every layer a graph of its own.
    """

    front_end = "regional"

    def __init__(self, model: nn.Module, reason: str, blocks: list[Any], dynamic_lengths: bool = False) -> None:
        self.blocks = blocks
        self.dynamic_lengths = dynamic_lengths  # read by the block runners (DynamoCapture's)
        self.graph_compiler: Callable[..., Any] | None = None  # regional compile, see compile_graphs
        self.installations = []
        self.lifted_for_good = False  # the compiled original model runs (lift_for_good)
        self._instance_tensors = {b.name: [{**dict(m.named_parameters()), **dict(m.named_buffers())}
                                           for _, m in b.instances] for b in blocks}
        plain_compile = inspect.unwrap(torch.compile)
        for b in blocks:
            runner = _BlockRunner(self, b, plain_compile)
            self.installations.append(install(b.cls, [m for _, m in b.instances], runner))
        # The forwards that call the blocks run as Python, not traced: Dynamo would trace each
        # of them (and each decorator around it) up to the first block call, find a graph break
        # in a loop, and drop the whole trace; what they call is still captured, frame by frame
        # (the embeddings, the mask, the final norm, the head and the loss). Skipped as frames
        # of their own, and, on this model's instances only, not inlined into the frame that
        # calls them either: a causal LM's head traced LlamaModel's forward twice that way, its
        # per-layer cache set-up included (90% of Dynamo's tracing at 16 layers), and dropped it.
        _release_dropped()
        functions, holders = _calling_frames(model, blocks)
        self._untraced = functions
        me = weakref.ref(self)
        self._not_inlined = [(weakref.ref(h), _not_inlined_forward(h, me)) for h in holders
                             if "forward" not in h.__dict__]
        for fn in functions:
            skip_code(fn.__code__)
        for holder, forward in self._not_inlined:
            holder().__dict__["forward"] = forward
        # undone by remove(), or, at our next call, after the capture is dropped
        self._unmark = weakref.finalize(self, _unmark, self._untraced, self._not_inlined)
        super().__init__(model, reason, dynamic_lengths=dynamic_lengths)

    def _same_in_every_instance(self, value: torch.Tensor, block: Any) -> bool:
        if block is None:
            return True
        tensors = self._instance_tensors[block.name]  # per instance: name -> tensor
        name = next((n for n, t in tensors[0].items() if t is value), None) or \
            next((n for per in tensors[1:] for n, t in per.items() if t is value), None)
        if name is None:  # a model tensor outside the block (a shared rotary table)
            return True
        return all(name in per and per[name].shape == value.shape and per[name].dtype == value.dtype
                   and torch.equal(per[name], value) for per in tensors)

    def compile_graphs(self, backend: Callable[..., Any],
                       source: Callable[[Any], Any] | None = None) -> None:
        """Regional compile: each graph is compiled by ``backend`` at its first run with
        ``switch.use_compiled``: a block's graph once for all the block's instances, each graph
        around the blocks (embeddings, the mask, the head and the loss) once; so is a graph
        Dynamo hands over later (a new signature). The cost stays that of one block at any
        depth, and the head and the loss are compiled too: BERT's MLM head (its softmax over
        the vocabulary) is where the compiler gains on that model (see RegionalCompiled).
        ``source(slot)``: the graph to compile instead of what the slot keeps (some kept
        rewrites set aside, ones the compiler makes itself; see rewriter.decide.set_aside), or
        :data:`EAGER`: not compiled, it runs what it keeps; a graph handed over later gets what
        it keeps."""
        self.graph_compiler = backend
        for s in self.slots:
            src = source(s) if source is not None else None
            # EAGER: the graph runs as it is kept, not compiled (rewriter.decide.set_aside)
            s.compiler, s.compiled_form = (None if src is EAGER else backend), None
            s.compile_source = None if src is EAGER else src

    @contextlib.contextmanager
    def engaged_in_thread(self) -> Iterator[None]:
        """The installed block graphs run for calls made in this thread during the body."""
        with contextlib.ExitStack() as stack:
            for inst in self.installations:
                stack.enter_context(inst.engaged_here())
            yield

    @property
    def engaged(self) -> bool:
        """Whether the installed block graphs run at every call (optimize() kept a rewrite)."""
        return any(inst.engaged for inst in self.installations)

    def engage(self) -> None:
        """From now on every registered instance runs its installed graphs (after optimize())."""
        for inst in self.installations:
            inst.engaged = True

    def remove(self) -> None:
        """Take the installed forwards off again: the classes' forwards are what they were, and
        Dynamo traces the forwards that call them again."""
        for inst in self.installations:
            inst.remove()
        self._unmark()
        _release_dropped()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.engaged_in_thread():
            return super().__call__(*args, **kwargs)

    @contextlib.contextmanager
    def lifted(self, nest: bool = False) -> Iterator[None]:
        """While the body runs, a trace of the model sees its own code: the registered
        instances' calls are not opaque (their flag is off) and the forwards that call them are
        inlined again; the installations stay (a compile of the original model, measured
        beside the rewritten one, is traced and guarded in this state). ``nest``: a repeated
        block's instances are traced as one nested compile region (:func:`_nested_instances`)."""
        flagged, marked = self._lift(nest)
        try:
            yield
        finally:
            for m in flagged:
                m.__dict__[FLAG] = True
                m.__dict__.pop(NESTED, None)
            for h, f in marked:
                h.__dict__["forward"] = f

    @property
    def nests(self) -> bool:
        """Whether ``lifted(nest=True)`` traces some block as one nested compile region a class."""
        return any(b.calls > 1 for b in self.blocks)

    def lift_for_good(self, nest: bool = False) -> None:
        """The state :meth:`lifted` makes, from now on: the compiled original model runs (its
        guards hold against the class patches, which stay, unengaged: every instance runs its
        own forward)."""
        for inst in self.installations:
            inst.engaged = False
        self._lift(nest)
        self._not_inlined.clear()
        self.lifted_for_good = True

    def _lift(self, nest: bool) -> tuple[list[nn.Module], list[tuple[nn.Module, Any]]]:
        """Turn the registered instances' flags off and take the not-inlined forwards off their
        holders; returns what was changed (instances, (holder, forward)) to put back."""
        flagged = [m for inst in self.installations for m in inst.instances() if FLAG in m.__dict__]
        marked = [(h, f) for ref, f in self._not_inlined if (h := ref()) is not None
                  and h.__dict__.get("forward") is f]
        for m in flagged:
            del m.__dict__[FLAG]
        for m in _nested_instances(self.blocks, flagged) if nest else ():
            m.__dict__[NESTED] = True
        for h, _ in marked:
            del h.__dict__["forward"]
        return flagged, marked

    def block_rows(self) -> list[dict]:
        """Per block class: instances, the graphs that run for it, and its nodes (the report)."""
        rows = []
        for b in self.blocks:
            mine = [s for s in self.slots if s.block == b.name]
            rows.append({"class": b.name, "instances": len(b.instances), "calls": b.calls,
                         "first": b.instances[0][0], "last": b.instances[-1][0],
                         "graphs": [s.name for s in mine],
                         "nodes": [len(s.original.graph.nodes) for s in mine],
                         "rewritten": any(s.rewritten for s in mine)})
        return rows


def _nested_instances(blocks: list[Any], flagged: list[nn.Module]) -> list[nn.Module]:
    """The instances a trace of the original model calls as one nested compile region a class
    (``torch.compiler.nested_compile_region``, rewriter.capture.install): those of a block called
    twice or more in a forward (two instances or more, or one called again: ALBERT's shared
    layer group), where a whole trace compiles each call again. bf16 autocast training, 4
    layers, a cold process each, 2-core Xeon with AMX (the README's figures; `python -m
    benchmarks.layer_compile --bf16 --forms whole nested`): the first compiled step GPT-2 36.7 ->
    31.7 s, BERT 28.4 -> 26.7 s, DistilBERT 28.7 -> 26.7 s; the steps level."""
    live = {id(m) for m in flagged}
    return [m for b in blocks if b.calls > 1 for _, m in b.instances if id(m) in live]


# Graphs one block class may have (signatures: train/eval, grad mode, prefill and decode shapes);
# past it Dynamo runs the block's own forward, unrewritten.
BLOCK_SIGNATURES = 16


def _call_block(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return forward(module, *args, **kwargs)


class _BlockRunner:
    """What an installed instance runs: its class's one compiled (captured) forward, unless hooks
    were added inside the block after it was captured (the graph would skip them), in which case
    the instance's own forward runs."""

    def __init__(self, cap: RegionalCapture, block: Any, plain_compile: Callable[..., Any]) -> None:
        # A code object of its own: Dynamo keeps compiled entries (and counts recompiles) per code
        # object, and every block class of every optimize() in the process would share one.
        code = _call_block.__code__.replace(co_name=f"_call_{block.name}")
        fn = types.FunctionType(code, _call_block.__globals__, code.co_name)
        self.compiled = plain_compile(fn, backend=_weak_backend(cap, block),
                                      dynamic=True if cap.dynamic_lengths else None)
        self.cap = cap
        self.inner = {id(m): [x for x in m.modules() if x is not m] for _, m in block.instances}
        self.hooks = {k: hooks_of(v) for k, v in self.inner.items()}
        self.layer_idx = {id(m): _layer_index(m) for _, m in block.instances}
        self.seen = torch.utils.hooks.RemovableHandle.next_id
        self.unhooked: set[int] = set()

    def __call__(self, module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._hooked_inside(module):
            return forward(module, *args, **kwargs)
        args, kwargs = _one_layer_caches(args, kwargs, self.layer_idx.get(id(module)))
        with self.cap.dynamo_settings(recompile_limit=BLOCK_SIGNATURES), \
                _unlogged_trace_headers_skipped(), code_entries.calling(self.cap):
            return self.compiled(module, forward, args, kwargs)

    def _hooked_inside(self, module: nn.Module) -> bool:
        if id(module) in self.unhooked:
            return True
        next_id = torch.utils.hooks.RemovableHandle.next_id
        if next_id == self.seen:
            return False
        changed = [k for k, mods in self.inner.items() if hooks_of(mods) != self.hooks[k]]
        if not changed:
            self.seen = next_id
            return False
        for k in changed:
            if k not in self.unhooked:
                warnings.warn("rewriter: hooks were added inside a rewritten block after optimize(); "
                              "that instance runs its original forward so they run (call optimize() "
                              "again to rewrite with them)", stacklevel=4)
            self.unhooked.add(k)
        return id(module) in self.unhooked


# What removed or dropped captures leave to undo at our next call: a collection can run inside
# a Dynamo trace, which must not see a code's state freed or a module's forward change under it.
_DROPPED: list[tuple[list[Any], list[Any]]] = []


def _not_inlined_forward(holder: nn.Module, capture: Any = None) -> Any:
    """``holder``'s forward, bound, as torch._dynamo.disable(recursive=False) makes it: run as
    Python, its callees traced as frames of their own, never inlined into its caller's trace.

    Dropout it runs itself (GPT-2's embedding dropout module, BART's ``F.dropout(x, p,
    training=self.training)``) runs eagerly there, outside every graph, so the numerics check's
    switch (``deterministic``, which turns dropout off in the graphs) would miss it: while
    ``capture`` (a weak reference) runs deterministic, its direct dropout modules' ``p`` is 0
    and, if its code calls a functional dropout, its own ``training`` is False (the module's
    flag only, not its children's). Never traced, so nothing guards on them; a torch-function
    mode or a patched ``F.dropout`` would be seen by the frames it calls, and Dynamo compiled
    them again for it."""
    forward_fn = unwrapped_class(holder).forward
    fn = torch._dynamo.disable(forward_fn, recursive=False)
    dropouts = dropout_modules(holder, recurse=False)
    functional = _names_functional_dropout(forward_fn)
    if not (dropouts or functional) or capture is None:
        return types.MethodType(fn, holder)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        cap = capture()
        if cap is None or not cap.switch.deterministic:
            return fn(self, *args, **kwargs)
        training = self.training
        self.training = training and not functional
        try:
            with dropout_modules_off(dropouts):
                return fn(self, *args, **kwargs)
        finally:
            self.training = training
    functools.update_wrapper(forward, forward_fn)
    return types.MethodType(torch._dynamo.disable(forward, recursive=False), holder)


def _names_functional_dropout(fn: Any) -> bool:
    """Whether ``fn``'s code calls a functional dropout: ``functional.dropout`` / ``F.dropout``
    (and the other functional dropouts) as an attribute of torch.nn.functional as it is
    spelled, not any attribute named ``dropout`` (``self.dropout(x)``, a module, or
    ``p=self.dropout``, a float: Wav2Vec2's encoder has both, and its layerdrop reads
    ``self.training``, which must stay as it is)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)  # (transformers decorates forwards)
    if code is None or not set(code.co_names) & set(FUNCTIONAL_DROPOUTS):
        return False
    ins = list(dis.get_instructions(code))
    return any(b.argval in FUNCTIONAL_DROPOUTS and b.opname.startswith("LOAD_")
               and a.opname.startswith("LOAD_") and a.argval in ("functional", "F")
               for a, b in zip(ins, ins[1:]))


def _drop_forwards(not_inlined: list[Any]) -> None:
    for ref, forward in not_inlined:
        holder = ref()
        if holder is not None and holder.__dict__.get("forward") is forward:
            del holder.__dict__["forward"]


def _unmark(untraced: list[Any], not_inlined: list[Any]) -> None:
    """Queue the undoing of a capture's marks (runs once: at remove(), or when the capture is
    collected); :func:`_release_dropped` undoes them."""
    _DROPPED.append((list(untraced), list(not_inlined)))
    untraced.clear()
    not_inlined.clear()


def _release_dropped() -> None:
    """Dynamo traces, and inlines, the forwards that call the blocks again."""
    while _DROPPED:
        untraced, not_inlined = _DROPPED.pop()
        for fn in untraced:
            reset_code(fn.__code__)
        _drop_forwards(not_inlined)


def _calling_frames(model: nn.Module, blocks: list[Any]) -> tuple[list[Any], list[nn.Module]]:
    """The forwards that call block instances (functions with a ``__code__``), and the modules
    whose forwards they are: the module holding each instance, directly or through a
    ModuleList/Sequential/ModuleDict, with the decorators wrapped around its forward. torch.nn's
    own classes are left alone (their code serves every model)."""
    modules = dict(model.named_modules())
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    codes: dict[int, Any] = {}
    holders: dict[int, nn.Module] = {}
    for b in blocks:
        for name, _ in b.instances:
            parent = name.rpartition(".")[0]
            while parent and isinstance(modules.get(parent), containers):
                parent = parent.rpartition(".")[0]
            holder = modules.get(parent)
            if holder is None or unwrapped_class(holder).__module__.split(".")[0] == "torch":
                continue
            holders[id(holder)] = holder
            fn: Any = unwrapped_class(holder).forward
            while fn is not None:
                if getattr(fn, "__code__", None) is not None:
                    codes[id(fn)] = fn
                fn = getattr(fn, "__wrapped__", None)
    return list(codes.values()), list(holders.values())


def _layer_index(block: nn.Module) -> int | None:
    for m in block.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            return idx
    return None


class _LayerCache:
    """One layer of a transformers ``Cache``, as the block writing it sees it: ``update(k, v,
    layer_idx)`` writes this layer whatever index it is given, so every instance's graph reads
    the same attributes and one graph serves them all. Anything else is the cache's own."""

    def __init__(self, cache: Any, layer: Any) -> None:
        self.__dict__["_cache"] = cache
        self.__dict__["layer"] = layer

    def update(self, key_states: Any, value_states: Any, layer_idx: Any = None, *args: Any,
               **kwargs: Any) -> Any:
        return self.layer.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_cache"], name)


def _one_layer_caches(args: tuple, kwargs: dict, idx: int | None) -> tuple[tuple, dict]:
    if idx is None:
        return args, kwargs

    def view(x: Any) -> Any:
        layers = getattr(x, "layers", None)
        if not (type(x).__name__.endswith("Cache") and isinstance(layers, list)
                and callable(getattr(x, "update", None))) or getattr(x, "offloading", False):
            return x
        grow = getattr(x, "layer_class_to_replicate", None)
        while grow is not None and len(layers) <= idx:
            layers.append(grow())
        return _LayerCache(x, layers[idx]) if idx < len(layers) else x
    return tuple(view(a) for a in args), {k: view(v) for k, v in kwargs.items()}
