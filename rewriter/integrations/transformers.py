"""Hugging Face ``Trainer``: one callback, optimized at the first real batch.

::

    from rewriter.integrations.transformers import RewriterCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[RewriterCallback()])
    trainer.train()
    trainer.callback_handler.callbacks[-1].report      # or <output_dir>/rewriter/report.md

Why a callback, and what it does at each point of Trainer's lifecycle:

* ``Trainer`` builds its optimizer and scheduler lazily inside ``train()`` and wraps the model
  (accelerate, DDP) there too, so nothing can be optimized when the Trainer is built. At
  ``on_train_begin`` both exist; the callback shadows the model's ``forward`` (an instance
  attribute, as accelerate does for autocast), so every call Trainer makes, through DDP or not,
  reaches it.
* The first ``forward`` in training mode carries the first real batch (``input_ids``,
  ``labels``, ... as the collator made them, plus ``num_items_in_batch`` where Trainer adds it):
  those are the example inputs. ``rewriter.optimize()`` runs there, with the optimizer Trainer
  built (the torch optimizer inside accelerate's ``AcceleratedOptimizer``), and switches it to
  its fused form in place, so the scheduler Trainer made keeps driving it. The measured step is
  forward + backward + ``optimizer.step()`` on that batch; measuring restores parameters,
  gradients, optimizer state and RNG bit for bit, so the run goes on as if it had not happened.
* Under ``torch.distributed`` (accelerate, ``torchrun``) every rank reaches its first forward
  together; rank 0 measures and the others replay its plan (``rewriter.devices.distributed``), so all
  ranks run the same graphs. Measuring runs no collectives.
* Checkpoints are Trainer's own ``save_pretrained`` of the model: the rewritten graphs share the
  model's tensors and change none of its keys, so ``from_pretrained`` loads them into the plain
  class, and a plain model's checkpoint resumes with the callback on.
* The report is ``callback.report``, logged as one line (logger
  ``rewriter.integrations.transformers``) and saved by ``report.save`` into
  ``<output_dir>/rewriter/`` on the main process (``report_dir=`` to change it).
* ``on_train_end`` restores the model's ``forward``: after ``train()`` the model is the plain
  model again (evaluation and ``generate`` always run it as it is).

Any keyword option of ``rewriter.optimize()`` passes through (``dtype=``, ``passes=``,
``time_budget=``, ``clock=``, ``gate=``, ``profile=``, ...); ``loss_fn`` defaults to the
model's own ``loss``, which is what Trainer trains unless it is given ``compute_loss_func``.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - exercised by the guard test with the import blocked
    raise ImportError("rewriter.integrations.transformers needs transformers and accelerate: "
                      "pip install 'rewriter[hf]'") from e

import rewriter
from rewriter.integrations._intercept import (
    MethodInterceptor,
    ModuleShell,
    check_options,
    example_inputs_of,
    summary,
)
from rewriter.report import Report
from rewriter.wrapper import OptimizedModel

log = logging.getLogger(__name__)

__all__ = ["RewriterCallback"]


class RewriterCallback(TrainerCallback):
    """Optimize the model at Trainer's first training batch; train on the rewritten graphs.

    Example::

        trainer = Trainer(model, TrainingArguments("out"), train_dataset=ds,
                          callbacks=[RewriterCallback()])
        trainer.train()

    Args:
        report_dir: where the report is saved (main process only); default
            ``<output_dir>/rewriter``. False: not saved.
        **options: keyword options of :func:`rewriter.optimize` (``dtype``, ``passes``,
            ``exclude``, ``loss_fn``, ``time_budget``, ``gate``, ``clock``, ``profile``, ...).
            ``optimizer`` and ``example_inputs`` come from the Trainer.

    Attributes:
        report: the :class:`rewriter.Report` once the first batch was optimized, else None.
        error: why nothing was optimized, when ``optimize()`` raised (training goes on with the
            model as it is, and the error is logged as a warning).
    """

    def __init__(self, *, report_dir: str | os.PathLike | bool | None = None, **options: Any) -> None:
        check_options(options)
        self.options = options
        self.report_dir = report_dir
        self.report: Report | None = None
        self.error: str | None = None
        self._step: MethodInterceptor | None = None
        self._optimizer: Any = None
        self._steps: int | None = None
        self._output_dir: str | None = None
        self._is_main = True

    # --- Trainer's events ----------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise ValueError("RewriterCallback: the Trainer passed no model to on_train_begin")
        self._output_dir = args.output_dir
        self._is_main = state.is_world_process_zero
        # the run's length, so a one-time cost (a compile) is weighed against it
        self._steps = state.max_steps if getattr(state, "max_steps", 0) and state.max_steps > 0 else None
        if self._step is None or self._step.model is not model or optimizer is not self._optimizer:
            # a new model, or a new optimizer (train() again): decide again at its first batch
            if self._step is not None:
                self._step.uninstall()
            self._step = MethodInterceptor(model, "forward", self._optimize_first_batch)
        self._optimizer = optimizer
        self._step.install()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._step is not None:
            self._step.uninstall()

    # --- the first batch -----------------------------------------------------------------
    def _optimize_first_batch(self, shell: ModuleShell, args: tuple, kwargs: dict) -> OptimizedModel | None:
        optimizer = _torch_optimizer(self._optimizer)
        try:
            example = example_inputs_of(args, kwargs)
            options = {"steps": self._steps, **self.options}  # the user's steps= wins
            result = rewriter.optimize(shell, example, optimizer=optimizer, **options)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            log.warning("rewriter: optimize() failed at the first batch, training the model as it "
                        "is: %s", self.error)
            return None
        if optimizer is not None:
            fast, switched = result
            if switched is not optimizer:
                _install_optimizer(self._optimizer, switched)
        else:
            fast = result
        self.report = fast.report
        log.info("%s", summary(fast.report))
        directory = self._report_directory()
        if directory is not None and self._is_main:
            fast.report.save(directory)
            log.info("rewriter: report saved in %s", directory)
        return fast

    def _report_directory(self) -> str | None:
        if self.report_dir is False:
            return None
        if self.report_dir not in (None, True):
            return os.fspath(self.report_dir)  # type: ignore[arg-type]
        return os.path.join(self._output_dir or ".", "rewriter")


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or the one given)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if optimizer is not None:
        log.info("rewriter: the Trainer's optimizer is a %s, not a torch optimizer; the forward "
                 "and backward are optimized, the optimizer is left as it is",
                 type(optimizer).__name__)
    return None


def _install_optimizer(trainer_optimizer: Any, replacement: torch.optim.Optimizer) -> None:
    """A fused replacement object (NPU, apex) goes inside accelerate's wrapper, which Trainer
    and its scheduler hold (the replacement shares the original's ``param_groups``)."""
    if hasattr(trainer_optimizer, "optimizer"):
        trainer_optimizer.optimizer = replacement
        return
    log.warning("rewriter: the fused optimizer is a new object (%s) and the Trainer's optimizer "
                "is not wrapped by accelerate, so the Trainer keeps its own", type(replacement).__name__)
