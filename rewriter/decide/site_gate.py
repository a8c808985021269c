"""Verify and time one region on its own: the original nodes against their replacement.

The inputs are the boundary values recorded in the model's own run (rewriter.capture.record). In
training a region runs forward and backward: the gradients of every boundary input that
required grad (activations and parameters alike) with a fixed random cotangent on each output,
so the fused backward is what is measured and checked::

    ok, detail, err = verify_region(region, values, training=True)
    m = measure_region(region, values, training=True, clock=clock, settings=settings)

Verification compares the replacement with the original at the region's own precision, and,
where the elementwise bound is exceeded, with a float64 run of the original region as the
yardstick (rewriter.decide.verify): the error is attributed to the site, at any model size.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch
from torch.fx import GraphModule
from torch.utils._pytree import tree_leaves

from rewriter.capture.record import Recorded
from rewriter.capture.region import Region, dtype_of_region, lowest_float_dtype
from rewriter.decide.gate import (
    Clock,
    GateSettings,
    Measurement,
    Step,
    clearly_one_way,
    conclusive_or_on_the_line,
    measure,
)
from rewriter.decide.fresh_heap import step_maps_fresh_pages
from rewriter.decide.verify import (
    FLOAT64_FACTOR,
    Comparison,
    Yardstick,
    compare_runs,
    dropout_disabled,
    tolerance_for,
)
from rewriter.devices.host_memory import trim_heap

REGION_SEED = 20261201
# How a region is timed, in its knowledge-base key: a change that moves its figures (version 2
# drew each output's cotangent once, where version 1 drew it inside every timed call) must not
# replay figures measured the old way.
REGION_TIMING = "3"  # 3: from a trimmed heap where the step maps fresh pages (fresh_heap)


def _cotangent(i: int, t: torch.Tensor) -> torch.Tensor:
    """Output ``i``'s cotangent: the same values in every dtype a region runs in (drawn in fp32,
    exact in fp64; fp64 draws took 0.76 s for an LM head's [1024, 32000], fp32 0.16 s)."""
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype)


class RegionCall:
    """One region form, ready to run on prepared inputs (forward, or forward + backward)."""

    def __init__(self, gm: GraphModule, values: list[Recorded], training: bool,
                 float64: bool = False, forward_only: bool = False) -> None:
        self.gm, self.training, self.forward_only = gm, training, forward_only
        self.inputs: list[Any] = []
        self.grad_inputs: list[int] = []
        for i, r in enumerate(values):
            v = r.value
            if isinstance(v, torch.Tensor):
                v = v.detach()
                if float64 and v.is_floating_point():
                    v = v.to(torch.float64)
                if training and r.requires_grad:
                    v = v.detach().requires_grad_(True)  # a leaf of our own; storage shared
                    self.grad_inputs.append(i)
            self.inputs.append(v)
        # Drawn once per output: a float64 draw costs about as much as the region itself
        # (9 ms for 4 x 256 x 256 here), and inside the timed call it would dilute every ratio.
        self._cotangents: dict[int, torch.Tensor] = {}

    def run(self) -> tuple[tuple, tuple]:
        """One run, what is timed: the outputs and the input gradients (training; with
        ``forward_only``, the forward as training runs it, saving for a backward not run)."""
        with torch.enable_grad() if self.training else torch.no_grad():
            outs = self.gm(*self.inputs)
            backward = self.training and self.grad_inputs and not self.forward_only
            grads = self._backward(outs) if backward else ()
        return outs, grads

    def __call__(self) -> dict[str, torch.Tensor]:
        """One run; outputs and input gradients by name (for verification)."""
        outs, grads = self.run()
        result = {f"output {i}": o.detach() for i, o in enumerate(outs) if isinstance(o, torch.Tensor)}
        for i, g in zip(self.grad_inputs, grads):
            result[f"grad input {i}"] = g.detach() if g is not None else torch.zeros_like(self.inputs[i])
        return result

    def _backward(self, outs: tuple) -> tuple:
        diff = [(i, o) for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not diff:
            return tuple(None for _ in self.grad_inputs)
        cots = [self._cotangent(i, o) for i, o in diff]
        return torch.autograd.grad([o for _, o in diff], [self.inputs[i] for i in self.grad_inputs],
                                   cots, allow_unused=True)

    def _cotangent(self, i: int, out: torch.Tensor) -> torch.Tensor:
        # a form's outputs keep their shape, dtype and device from call to call (fixed inputs)
        if i not in self._cotangents:
            self._cotangents[i] = _cotangent(i, out)
        return self._cotangents[i]


def _seeded_numerics(call: RegionCall) -> dict[str, torch.Tensor]:
    torch.manual_seed(REGION_SEED)
    with dropout_disabled():
        return call()


def verify_region(region: Region, values: list[Recorded], training: bool,
                  forms: tuple[GraphModule, GraphModule] | None = None,
                  precision: torch.dtype | None = None) -> Comparison:
    """The replacement against the original region, at the region's precision.

    ``forms``: (before, after) to run instead of the region's own (the region with the
    precision overlay applied); ``precision``: the dtype that overlay computes in. Its inputs
    are recorded in fp32, but a region that computes in bf16 is held to bf16's tolerance (the
    flash kernel's bf16 attention differs from the written-out one by bf16 rounding)."""
    before, after = forms or (region.before, region.after)
    dtype = lowest_float_dtype([dtype_of_region([v.value for v in values])]
                               + ([precision] if forms is not None and precision is not None else []))
    try:
        want = _seeded_numerics(RegionCall(before, values, training))
    except Exception as e:  # noqa: BLE001 (the original region itself: not the site's fault)
        return Comparison(False, math.inf, problem=f"the original region does not run alone "
                          f"({type(e).__name__}: {e})")
    try:
        got = _seeded_numerics(RegionCall(after, values, training))
    except Exception as e:  # noqa: BLE001
        return Comparison(False, math.inf, problem=f"the replacement raised: {type(e).__name__}: {e}")
    tol = tolerance_for(dtype)
    c = compare_runs(got, want, tol)
    if c.ok:
        return c
    try:
        exact = _seeded_numerics(RegionCall(region.before, values, training, float64=True))
    except Exception:  # noqa: BLE001 (a region that insists on its dtype: the bound alone)
        return c
    return compare_runs(got, want, tol, yardstick=Yardstick("float64", exact, FLOAT64_FACTOR))


def held_for_backward(region: Region, values: list[Recorded],
                      forms: tuple[GraphModule, GraphModule] | None = None) -> tuple[int, int]:
    """Bytes autograd keeps for backward after one forward of the original and of the
    replacement (training): the region's share of the step's activation memory.

    Between a layer's forward and its backward, what stays live of it is what autograd saved,
    and that adds up over the layers: the written-out attention keeps its [heads, seq, seq]
    probabilities, SDPA its output and log-sum-exp. Unlike a peak it does not jitter; it is
    what autograd saves on this device (SDPA saves what the kernel it picks needs, and an
    autograd.Function that keeps tensors as ``ctx`` attributes is not seen). Storages of the
    boundary inputs (parameters, the activations read) are not counted: they are live either
    way. An output a form saves is counted, though the op after the region may keep it anyway::

        before, after = held_for_backward(region, values)
    """
    before, after = forms or (region.before, region.after)
    return (_saved_bytes(RegionCall(before, values, training=True)),
            _saved_bytes(RegionCall(after, values, training=True)))


def _saved_bytes(call: RegionCall) -> int:
    inputs = {_storage(t)[0] for t in tree_leaves(call.inputs) if isinstance(t, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr not in inputs:
            saved[ptr] = nbytes  # one storage saved twice (a view of it) is held once
        return t

    # autograd holds the saved tensors until the outputs are dropped, so no storage of one
    # is reused by a later one within the forward; dropout runs (its mask is saved too). Only
    # the CPU generator is forked: the pipeline's snapshot puts a device's back (as for timing)
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call.gm(*call.inputs)
    return sum(saved.values())


def _storage(t: torch.Tensor) -> tuple[int, int]:
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
        return id(t), 0


def _repeated(call: RegionCall, reps: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(reps):
            call.run()
    return run


def measure_region(region: Region, values: list[Recorded], training: bool, *, clock: Clock,
                   settings: GateSettings, min_speedup: float,
                   forms: tuple[GraphModule, GraphModule] | None = None,
                   deadline: float | None = None,
                   original_seconds: float | None = None, fresh_heap: bool = False,
                   forward_only: bool = False) -> Measurement:
    """Interleaved A/B of the two forms, each sample long enough for the timer (repeats).

    ``original_seconds``: one call of the original, timed already (:func:`original_ms`), so
    the original has had its first call and its repeats need no timing of their own.
    ``fresh_heap``: the user's step maps fresh pages (rewriter.decide.fresh_heap); then, if the
    original region itself does (:func:`maps_fresh_pages`), each sample of either form starts
    from a trimmed heap (:func:`heap_as_a_step_leaves_it`). ``forward_only`` (training): both
    forms timed without their backward (``Pass.same_backward``); ``original_seconds``, a
    forward and backward's, is then timed again, forward only.

    Each form has had a first call before the warm-up (allocator, kernels picked); a sample
    of one long call (an LM head's) then needs one warm-up round, not two: 0.15 s of each
    comparison on Granite's fp32 head (~80 ms a call, 2-core AMD EPYC)."""
    before, after = forms or (region.before, region.after)
    a = RegionCall(before, values, training, forward_only=forward_only)
    b = RegionCall(after, values, training, forward_only=forward_only)
    with torch.random.fork_rng(devices=[]):
        if original_seconds is None or (forward_only and training):  # the first call is timed
            original_seconds = one_call_ms(a.run, clock) / 1e3
        else:
            a.run()  # its cotangents drawn (its first call came with the earlier timing)
        b.run()  # first call: allocator, kernels picked
        reps = repeats_for(original_seconds, settings.region_sample_seconds)
        trim = heap_as_a_step_leaves_it if fresh_heap and maps_fresh_pages(a.run) else None
        base = Step(_repeated(a, reps), (), "original region", scope="region", reps=reps, before_sample=trim)
        cand = Step(_repeated(b, reps), (region.pass_name,), "replacement", scope="region", reps=reps,
                    before_sample=trim)
        fewest = region_fewest_pairs(original_seconds, settings)
        quick_warmup = dataclasses.replace(settings, warmup_seconds=settings.region_warmup_seconds,
                                           warmup=region_warm_up_rounds(fewest, settings),
                                           budget_seconds=min(settings.budget_seconds,
                                                              settings.region_budget_seconds),
                                           max_pairs=max(settings.max_pairs, settings.region_max_pairs),
                                           min_pairs=fewest)
        long_samples = fewest == settings.min_pairs  # samples like a step's (an LM head's)
        return measure(base, cand, clock=clock, settings=quick_warmup, min_speedup=min_speedup,
                       deadline=deadline,
                       enough=conclusive_or_on_the_line(min_speedup, settings.region_indifference,
                                                        settings.noise_widths),
                       early=clearly_one_way(min_speedup, settings) if long_samples else None)


def region_fewest_pairs(original_seconds: float, settings: GateSettings) -> int:
    """The fewest pairs a region's verdict stands on. Short samples: more of them; a region
    long enough to be timed once (an LM head's loss, ~110 ms) has samples like a step's, and
    a step's fewest pairs, and its early verdict (gate.clearly_one_way: LLaMA's fp32 LM head
    under onednn_linear, 1.6x, took 6 pairs of ~0.1 s)."""
    if original_seconds >= ONE_CALL_IS_ENOUGH_S:
        return settings.min_pairs
    return max(settings.min_pairs, min(settings.region_min_pairs, settings.max_pairs))


def region_warm_up_rounds(fewest: int, settings: GateSettings) -> int:
    """Untimed rounds after each form's first call: one where a sample is one long call (its
    fewest pairs a step's, :func:`region_fewest_pairs`), else the settings' own."""
    return 1 if fewest == settings.min_pairs else settings.warmup


# A training region's forward, as a share of its forward and backward, where only the forward
# is timed (Pass.same_backward): a Linear's, one GEMM of its three (reuse_linear_output's, the
# one such pass). A lower bound's input, so it errs towards measuring.
FORWARD_SHARE = 1 / 3


def least_measuring_seconds(original_seconds: float, settings: GateSettings,
                            saves_at_most: float = 1.0, forward_only: bool = False) -> float:
    """The least a region's comparison can take: its warm-up runs and fewest pairs, each pair
    a sample of the original (one call, or the repeats that make ``region_sample_seconds``)
    and one of the replacement at its fastest (``saves_at_most``: the share of the original
    the pass can save at most, ``Pass.saves_at_most``). A budget with less left than this
    ends the comparison before any verdict: LLaMA 32k at steps=100 spent 3.6 s verifying and
    timing the kept LM-head output (~0.2 s a call, a third of it saved at most) for one pair
    and "not reached". A lower bound, so nothing that could finish is left out: the loss
    (~0.11 s a call, 3.4x faster) took 1.3 s where the original alone gives 0.9 s.
    ``forward_only``: ``original_seconds`` is a forward and backward's, the samples forward
    only, taken as ``FORWARD_SHARE`` of it."""
    if forward_only:
        original_seconds *= FORWARD_SHARE
    sample = max(original_seconds, settings.region_sample_seconds)
    fewest = region_fewest_pairs(original_seconds, settings)
    return sample * (2 - saves_at_most) * (region_warm_up_rounds(fewest, settings) + fewest)


def original_ms(region: Region, values: list[Recorded], training: bool, *, clock: Clock,
                forms: tuple[GraphModule, GraphModule] | None = None) -> float:
    """Milliseconds of one call of the original region (the fastest of three, after a first
    call): what a replacement could save at most. A region cheaper than the saving that would
    matter is not worth an A/B comparison (index arithmetic of a few microseconds)."""
    call = RegionCall((forms or (region.before, region.after))[0], values, training)
    with torch.random.fork_rng(devices=[]):
        return one_call_ms(call.run, clock)


# A call whose first timing takes this long is timed once: the fastest of three is for calls
# of microseconds, where one sample is mostly noise; an LM head's region (~200 ms on a 2-core
# CPU) timed three times more cost 0.4 s of a short run's ~13 s budget.
ONE_CALL_IS_ENOUGH_S = 0.05


def one_call_ms(run: Callable[[], Any], clock: Clock) -> float:
    """What one call of an original region (``run``) takes, in ms: a first (untimed) call,
    then the fastest of three timed ones, or the first timed one alone when it takes
    ``ONE_CALL_IS_ENOUGH_S`` or more."""
    once = Step(run, (), "original region, one call", scope="region")
    run()
    first = clock.time(once)
    if first >= ONE_CALL_IS_ENOUGH_S:
        return 1e3 * first
    return 1e3 * min([first] + [clock.time(once) for _ in range(2)])


def heap_as_a_step_leaves_it() -> None:
    """Before a region's sample, untimed, where the user's step maps fresh pages
    (rewriter.decide.fresh_heap): its free heap handed back, as the rest of a step's frees
    leave it, so a large tensor the region allocates comes on fresh pages there as in the
    step. Timed alone, a region reuses what it freed a moment ago, or not, by the heap's
    history: BERT's loss region, fp32, 2-core AMD EPYC, its original 5.5 ms or 11.5 ms (32 MB
    mapped afresh) from sample to sample, the fused loss 7 ms, and the verdict 0.79-1.56x
    over six decisions, where in the step the fused loss saves ~9 % (225.9 -> 206.9 ms, 30
    interleaved steps). From a trimmed heap: 22.4 ms (three 32 MB tensors, 24 000 fresh
    pages, every sample) against 6.6-7.4 ms, 3.1-3.4x in three decisions of three."""
    trim_heap()


def maps_fresh_pages(run: Callable[[], Any]) -> bool:
    """Whether one call of ``run`` (an original region), from a trimmed heap, maps
    ``FRESH_PAGES`` or more: tensors as large as those glibc hands back. A smaller region's
    samples are timed as they run: trimming before each would add the faults of tensors the
    step keeps reusing, and seconds to every comparison (LLaMA, fp32, every region trimmed:
    its decisions 3.4 -> 4.7 s, its RMSNorm's 0.18 -> 0.50 s)."""
    heap_as_a_step_leaves_it()
    return bool(step_maps_fresh_pages(run))


def repeats_for(t: float, target_seconds: float, max_reps: int = 10_000) -> int:
    """Repetitions per sample of a call of ``t`` seconds so that a sample lasts about
    ``target_seconds``."""
    if t <= 0 or not math.isfinite(t):
        return 1
    return int(min(max_reps, max(1, math.ceil(target_seconds / t))))


def deadline_in(seconds: float | None) -> float | None:
    return None if seconds is None else time.perf_counter() + seconds
