"""``rewriter.optimize``: the public entry point."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from rewriter.capture import install
from rewriter.decide.amortize import check_steps
from rewriter.decide.gate import Clock, GateSettings
from rewriter.decide.generation import check_generate, generation_for
from rewriter.decide.job import Job, model_device, split_inputs
from rewriter.decide.knowledge import KnowledgeBase
from rewriter.decide.memory import check_objective
from rewriter.devices import distributed
from rewriter.devices.backends import Backend, get_backend
from rewriter.devices.gathered import fsdp2_modules, gathered, sharded_optimizer_note
from rewriter.pass_api import Pass, PassContext, resolve_passes
from rewriter.pipeline import DEFAULT_TIME_BUDGET, Outcome, Settings, run_pipeline
from rewriter.report import Report
from rewriter.wrapper import OptimizedModel

_HALF_DTYPES = (torch.bfloat16, torch.float16)
COMPILE_CHOICES = frozenset({"auto", "inductor", "npugraph_ex", "npugraphs", "torchair"})


def optimize(
    model: nn.Module,
    example_inputs: tuple | list | dict | torch.Tensor | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    passes: Sequence[str | Pass] | None = None,
    exclude: str | Sequence[str] = (),
    device: str | torch.device | Backend | None = None,
    min_speedup: float = 1.05,
    objective: str = "time",
    memory_slowdown: float = 0.03,
    plan: str | dict | None = None,
    cache_dir: str | None = None,
    knowledge_base: str | os.PathLike | bool | None = None,
    time_budget: float | None = DEFAULT_TIME_BUDGET,
    front_end: str = "auto",
    profile: bool | str = "auto",
    progress: bool = True,
    gate: GateSettings | None = None,
    clock: Clock | None = None,
    compile: bool | str | Callable[..., Any] = "auto",
    regional: bool | str = "auto",
    steps: int | None = None,
    generate: bool | int | str = "auto",
) -> OptimizedModel | tuple[OptimizedModel, torch.optim.Optimizer]:
    """Rewrite ``model`` and keep each rewrite only if it measures faster and matches numerically.

    Examples::

        fast = rewriter.optimize(model, example_inputs=(x,))                 # inference
        fast, opt = rewriter.optimize(model, example_inputs=(x,), optimizer=opt,
                                      loss_fn=lambda out: F.cross_entropy(out, y))  # training
        fast = rewriter.optimize(model)        # optimizes at the first call, on its inputs
        print(fast.report)

    Args:
        model: the ``nn.Module`` to optimize. It is never modified; the returned module shares
            its tensors (``state_dict()`` keys are the original ones).
        example_inputs: positional args (tuple/list, or one tensor) or keyword args (dict) of one
            representative call. None: capture and decide at the first call.
        optimizer: training mode; the gate measures forward + backward + ``optimizer.step()``,
            and tries the device's fused form of the same algorithm (``fuse_optimizer``). The
            second element of the result: the same object switched in place where torch
            allows (its state and any LR scheduler carry on), else a replacement.
        loss_fn: ``loss_fn(output) -> scalar``. Default in training: ``output.loss`` if present,
            else a fixed random cotangent on the outputs.
        dtype: ``torch.bfloat16``/``torch.float16`` allows precision-lowering (``reduced``)
            passes and verifies with that dtype's tolerance; None keeps fp32 numerics.
        passes: names of registered passes or Pass objects to try, in order (default: all);
            those with sites are measured hottest first, never past one they compose with
            (rewriter.decide.hot_first).
        exclude: names of passes not to try.
        device: "cpu", "cuda", "npu" or a Backend; default: where the model's parameters are.
        min_speedup: the margin: a rewrite is kept when its region (or, for passes without a
            local region, the whole step) is at least this much faster and clear of the noise.
        objective: "time" (default): keep what is faster. "memory": also keep a rewrite that
            lowers the step's peak memory (bytes allocated during one step above those live
            when it began, by at least 1%) while the step stays at most ``memory_slowdown``
            slower; a faster rewrite that raises the peak is not kept. Decided on the whole
            step for step-scope passes. Region passes, in training, on what a site holds for
            backward (the bytes autograd saves, beyond its inputs): kept when it holds at least
            1% less (over its sites, at least 1% of the parameters' bytes) and the region is at
            most ``memory_slowdown`` slower on its own; a faster one that holds more is not
            kept; without a usable time figure the time verdict stands. In inference, on time.
            In training this
            lets ``fuse_linear_cross_entropy`` set the output's ``logits`` to None (the loss and
            gradients are unchanged; see passes/README.md). The report says which objective
            decided each rewrite.
        memory_slowdown: the slowdown ``objective="memory"`` accepts for a memory saving
            (0.03: up to 3% slower), in [0, 1).
        plan: a plan (path or dict, from ``report.save``) to replay without measuring.
        cache_dir: a decision cache: a plan made for the same graphs, input shapes, device,
            versions and passes is replayed from here instead of measuring again.
        knowledge_base: where region decisions are kept per signature and reused across runs
            and models: a JSON file or a directory; None/True: ``$REWRITER_KNOWLEDGE_BASE``,
            else ``~/.cache/rewriter/knowledge_base.json``; False: not kept.
        time_budget: seconds optimize() may spend deciding (profiling aside); what it did not
            reach is reported as not reached, never kept unmeasured. None: no bound. With
            ``steps`` given, at most a tenth of the run's length (at least 8 s).
        front_end: "auto" (symbolic_trace when it captures the whole model, else Dynamo),
            "fx" or "dynamo".
        profile: profile the step before and after once, for the report's operator tables.
            "auto" (default): unless ``steps`` makes the run short (its time budget capped).
        progress: log progress lines to stderr while measuring.
        gate: measurement budget (warm-up, pair counts, seconds per comparison).
        clock: replaces the wall clock (tests use a controlled one).
        compile: the device's graph compiler as one more gated candidate, after the rewrites:
            the rewritten model compiled (Inductor on CPU/CUDA; on NPU Inductor with
            triton-ascend, npugraph_ex, npugraphs, TorchAir-GE where available; a regional
            capture compiles each graph once, a block's for all its instances, without the
            kept rewrites the compiler makes itself), verified, and kept
            only when the whole step measures faster than the rewritten eager step. A compile
            is a one-time cost weighed against ``steps`` (rewriter.decide.amortize). "auto"
            (default): on every device, when the predicted compile seconds could be repaid
            within the first tenth of the run (at best half of each step saved; the knowledge
            base's figure once it has one), and kept when the measured saving repays the
            measured compile seconds within the run (paid by then); True: compiled and measured whatever the cost
            (weighed only when ``steps`` is given); False: never; an executor name
            ("inductor", "npugraphs", ...) or a torch.compile backend callable: that one, as
            True. Inductor's persistent caches are kept beside the knowledge base
            (``<folder>/inductor``) unless ``TORCHINDUCTOR_CACHE_DIR`` is set.
        regional: decide per repeated block and install the result in every instance
            (rewriter.capture.blocks, rewriter.capture.install): each block class (modules of one class repeated
            in a ModuleList/Sequential; a transformers model's ``_no_split_modules``) is
            captured once on the inputs of its first instance, its rewrites decided once, and
            its rewritten forward installed behind every instance's own call, so hooks, FSDP2,
            activation checkpointing and generate() run around it; the rest of the model is
            captured around the blocks. The installed forwards stay on the model's block classes
            for registered instances only; ``rewriter.restore(model)`` (or ``fast.restore()``)
            takes them off. "auto" (default): when the model has blocks and does not trace
            whole with symbolic_trace, or names its blocks (``_no_split_modules``); True: when
            it has blocks; False: one capture of the whole model.
        steps: how many steps (training) or calls (inference) the run will make; a one-time
            cost is paid where predicted to repay within a tenth of it, and what was paid is
            kept where it repays within it. The trainer integrations pass theirs
            (transformers' ``max_steps``, Lightning's ``estimated_stepping_batches``). None:
            1000 for ``compile="auto"`` (a short fine-tuning run), not weighed for others.
            Known, it also bounds deciding: ``time_budget`` becomes at most a tenth of the
            run (at least 8 s). With a generation workload, a step is one prefill and its
            decode calls.
        generate: inference of a model that generates with a KV cache (rewriter.decide.generation):
            the measured step is the calls the model's own greedy ``generate()`` makes for the
            prompt in ``example_inputs`` (``input_ids``, optionally ``attention_mask``): the
            prefill and decode calls, one new token each against the cache, recorded once and
            replayed with the original model's tokens; the prefill and the decode signatures
            are decided together, and ``fast.generate(...)`` runs them (or, when kept, the
            compiled forward). "auto" (default): for a model that says it can generate
            (transformers' ``can_generate()``), 8 decode calls, else one call; True: the same,
            an error when the model has no decode call; an int: that many; False: one call.

    Returns:
        The optimized model, or ``(model, optimizer)`` when an optimizer is given.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, OptimizedModel):
        raise ValueError("this model was already returned by optimize(); pass model.original")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if dtype is not None and dtype not in _HALF_DTYPES:
        raise ValueError(f"dtype must be None, torch.bfloat16 or torch.float16, got {dtype!r}")
    if not (isinstance(min_speedup, (int, float)) and min_speedup >= 1.0):
        raise ValueError(f"min_speedup must be a number >= 1.0, got {min_speedup!r}")
    check_objective(objective, memory_slowdown)
    if front_end not in ("auto", "fx", "dynamo"):
        raise ValueError(f"front_end must be 'auto', 'fx' or 'dynamo', got {front_end!r}")
    if time_budget is not None and not (isinstance(time_budget, (int, float)) and time_budget > 0):
        raise ValueError(f"time_budget must be a positive number of seconds or None, got {time_budget!r}")
    if not (knowledge_base is None or isinstance(knowledge_base, (bool, str, os.PathLike))):
        raise TypeError("knowledge_base must be a path, True, False or None, got "
                        f"{type(knowledge_base).__name__}")
    if gate is not None and not isinstance(gate, GateSettings):
        raise TypeError(f"gate must be a rewriter.GateSettings, got {type(gate).__name__}")
    if not (isinstance(compile, bool) or compile in COMPILE_CHOICES or
            (callable(compile) and not isinstance(compile, str))):
        raise ValueError(f"compile must be 'auto', True, False, one of {sorted(COMPILE_CHOICES - {'auto'})} "
                         f"or a torch.compile backend callable, got {compile!r}")
    steps = check_steps(steps)
    generate = check_generate(generate)
    if profile not in (True, False, "auto"):
        raise ValueError(f"profile must be True, False or 'auto', got {profile!r}")
    if regional not in ("auto", True, False):
        raise ValueError(f"regional must be 'auto', True or False, got {regional!r}")
    if clock is not None and not callable(getattr(clock, "time", None)):
        raise TypeError(f"clock must have a time(step) method, got {type(clock).__name__}")
    chosen = resolve_passes(passes, exclude)
    backend = get_backend(device if device is not None else model_device(model))
    if not isinstance(device, Backend) and not backend.is_available():
        raise ValueError(f"device {backend.name!r} is not available on this machine"
                         + (" (torch_npu cannot be imported)" if backend.name == "npu" else ""))
    if optimizer is not None:
        _check_optimizer_params(model, optimizer)
    distributed.check_not_sharded(model)
    settings = Settings(min_speedup=float(min_speedup), front_end=front_end,
                        gate=gate or GateSettings(), clock=clock, profile=profile, plan=plan,
                        replace_optimizer=example_inputs is not None, cache_dir=cache_dir,
                        time_budget=float(time_budget) if time_budget is not None else None,
                        knowledge_base=KnowledgeBase.at(knowledge_base), compile=compile,
                        objective=objective, memory_slowdown=float(memory_slowdown),
                        regional=regional, steps=steps)

    def run(args: tuple, kwargs: dict) -> Outcome:
        _check_input_devices(model, args, kwargs)
        # an earlier optimize() of this model installed block forwards: measure against the
        # model's own code (this run installs its own)
        install.restore(model)
        training = optimizer is not None or loss_fn is not None or model.training
        if training and not any(p.requires_grad for p in model.parameters()):
            training = False  # nothing to train: the step is the forward pass
        # Sharded by FSDP2: decided on the gathered parameters (rewriter.devices.gathered); the
        # optimizer holds the shards, which no measured step updates, so it is not decided.
        sharded = bool(fsdp2_modules(model))
        job = Job(model, args, kwargs, backend, training, None if sharded else optimizer,
                  loss_fn, dtype)
        note = ""
        # nor the compiler: a compile timed on the gathered parameters is not the sharded step
        here = dataclasses.replace(settings, compile=False) if sharded else settings
        with _progress_to_stderr(progress), gathered(model):
            if not training:
                job.generation, note = generation_for(model, args, kwargs, generate,
                                                      backend.rng_states())
            if not distributed.is_multi_rank():
                outcome = run_pipeline(job, chosen, here)
            else:
                outcome = _run_on_every_rank(job, chosen, here)
        if note:
            outcome.report.notes.append(note)
        if sharded and settings.compile is not False:
            outcome.report.notes.append(
                "compile: not tried: the model is sharded by FSDP2, and a compile measured on its "
                "gathered parameters would not time the sharded step; compile the blocks under "
                "FSDP2 yourself (fast.compile()) or optimize() before fully_shard()")
        if sharded and optimizer is not None:
            outcome.optimizer = optimizer
            outcome.report.notes.append(sharded_optimizer_note(optimizer))
        return outcome

    result = OptimizedModel(model, pending=run)
    if example_inputs is None:
        return (result, optimizer) if optimizer is not None else result
    args, kwargs = split_inputs(example_inputs)
    result._optimize_now(args, kwargs)
    if optimizer is not None:
        return result, result._outcome.optimizer
    return result


def restore(model: nn.Module) -> int:
    """Take what optimize() installed off ``model`` (the optimized model, or the model given
    to it): the block classes' forwards are exactly what they were, and an optimized model runs
    the original model from now on, not a compiled form of it either. Returns how many block
    installations were removed::

        fast = rewriter.optimize(model, example_inputs=(x,))
        rewriter.restore(fast)        # or fast.restore(); rewriter.restore(model) likewise
    """
    if isinstance(model, OptimizedModel):
        return model.restore()
    return install.restore(model)


def _run_on_every_rank(job: Job, passes: list[Pass], settings: Settings) -> Outcome:
    """Rank 0 decides (or replays the user's plan); every other rank replays rank 0's plan."""
    if distributed.rank() == 0:
        try:
            outcome = run_pipeline(job, passes, settings)
        except BaseException as e:
            # The other ranks wait in the broadcast: tell them, or their next collective pairs
            # with the wrong one.
            distributed.share_plan({"error": f"{type(e).__name__}: {e}"})
            raise
        distributed.share_plan(outcome.report.plan or {})
        return outcome
    plan = distributed.share_plan(None)
    if "error" in plan:
        raise RuntimeError(f"rank 0 failed to optimize, so no rank rewrites: {plan['error']}")
    if not plan.get("kept_passes") and not plan.get("optimizer"):
        report = Report(model=type(job.model).__name__, device=job.backend.name, mode=job.mode,
                        dtype=None, final={"kept": False, "reason": "rank 0 kept no rewrite"})
        return Outcome(report, None, [], True, PassContext(job.backend, job.training, job.dtype),
                       job.optimizer)
    return run_pipeline(job, passes, dataclasses.replace(settings, plan=plan, strict_plan=True))


def _check_input_devices(model: nn.Module, args: tuple, kwargs: dict) -> None:
    devices = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if len(devices) != 1:
        return  # no tensors, or a model spread over devices: nothing to check against
    (model_device,) = devices
    leaves, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device != model_device:
            raise ValueError(f"example input {i} is on {leaf.device} but the model is on "
                             f"{model_device}; move one of them")


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} tensor(s) that are not parameters of the "
                         "model; build it from model.parameters()")


class _progress_to_stderr:
    """While optimizing, show the 'rewriter.progress' log lines on stderr (unless configured)."""

    def __init__(self, enabled: bool) -> None:
        self.logger = logging.getLogger("rewriter.progress")
        self.handler: logging.Handler | None = None
        self.enabled = enabled and not self.logger.handlers and not logging.getLogger().handlers

    def __enter__(self) -> None:
        if self.enabled:
            self.handler = logging.StreamHandler(sys.stderr)
            self.handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(self.handler)
            self.old_level = self.logger.level
            self.logger.setLevel(logging.INFO)

    def __exit__(self, *exc: Any) -> None:
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.logger.setLevel(self.old_level)
