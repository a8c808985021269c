"""Lightning: one callback; the LightningModule's ``training_step`` is the step measured.

::

    from rewriter.integrations.lightning import RewriterCallback

    trainer = lightning.Trainer(max_steps=100, callbacks=[RewriterCallback()])
    trainer.fit(module, train_dataloaders=loader)
    trainer.callbacks[...].report                  # or <default_root_dir>/rewriter/report.md

What it does at each point of ``Trainer.fit``:

* ``on_fit_start`` (after ``configure_optimizers`` and the strategy's wrapping): the module's
  ``training_step`` is shadowed by an instance attribute, so the strategy's call, through DDP's
  forward redirection or not, reaches it.
* The first ``training_step`` call carries the first real batch (already on the device) and
  ``batch_idx``: those are the example inputs. ``rewriter.optimize()`` captures and measures
  ``training_step`` itself (forward, the loss it returns, backward and
  ``optimizer.step()`` of the optimizer ``configure_optimizers`` returned, switched to its fused
  form in place so its LR schedulers carry on). ``self.log`` calls made while measuring are
  dropped (they would add measuring runs to the epoch's logged means), and ``self.log`` always
  runs outside the captured graphs.
* Under DDP every rank reaches its first ``training_step`` together; rank 0 measures and the
  others replay its plan.
* ``on_fit_end`` restores ``training_step``. Validation, test and predict steps are not touched.

Checkpoints are Lightning's own (``state_dict()`` of the module): the rewritten graphs share
the module's tensors and keys, so they load into the plain class.

Automatic optimization only: with ``automatic_optimization = False`` the step runs its own
backward and ``optimizer.step()``, which measuring would repeat; the callback then leaves the
module alone and says why in ``callback.error``.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as e:  # pragma: no cover - exercised by the guard test with the import blocked
    raise ImportError("rewriter.integrations.lightning needs Lightning: "
                      "pip install 'rewriter[lightning]'") from e

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

_LOGGING_METHODS = ("log", "log_dict")


def step_loss(output: Any) -> torch.Tensor:
    """The loss ``training_step`` returned: a tensor, or the ``"loss"`` of a dict."""
    if isinstance(output, Mapping):
        return output["loss"]
    return output


class RewriterCallback(Callback):
    """Optimize ``training_step`` at the first training batch; train on the rewritten graphs.

    Example::

        trainer = lightning.Trainer(max_epochs=1, callbacks=[RewriterCallback()])
        trainer.fit(module, loader)

    Args:
        report_dir: where the report is saved (global rank 0 only); default
            ``<default_root_dir>/rewriter``. False: not saved.
        **options: keyword options of :func:`rewriter.optimize` (``dtype``, ``passes``,
            ``time_budget``, ``gate``, ``clock``, ``profile``, ...). ``loss_fn`` defaults to
            the loss ``training_step`` returns.

    Attributes:
        report: the :class:`rewriter.Report` once the first batch was optimized, else None.
        error: why nothing was optimized (training goes on with the module as it is).
    """

    def __init__(self, *, report_dir: str | os.PathLike | bool | None = None, **options: Any) -> None:
        check_options(options)
        self.options = {"loss_fn": step_loss, **options}
        self.report_dir = report_dir
        self.report: Report | None = None
        self.error: str | None = None
        self._step: MethodInterceptor | None = None
        self._trainer: Trainer | None = None
        self._measuring = False
        self._logging_installed: list[str] = []

    # --- Lightning's hooks ---------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not pl_module.automatic_optimization:
            self.error = ("manual optimization: training_step runs its own backward and "
                          "optimizer.step(), which measuring would repeat; left as it is")
            log.warning("rewriter: %s", self.error)
            return
        self._trainer = trainer
        if self._step is None or self._step.model is not pl_module:
            self._step = MethodInterceptor(pl_module, "training_step", self._optimize_first_batch)
        self._step.install()
        self._quiet_logging(pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore(pl_module)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(pl_module)

    def _restore(self, pl_module: LightningModule) -> None:
        if self._step is not None:
            self._step.uninstall()
        for name in self._logging_installed:
            pl_module.__dict__.pop(name, None)
        self._logging_installed = []

    def _quiet_logging(self, pl_module: LightningModule) -> None:
        """``self.log``/``log_dict``: dropped while measuring, and never traced into a graph."""
        for name in _LOGGING_METHODS:
            if name in pl_module.__dict__:
                continue  # the user's own instance attribute: leave it
            original = getattr(pl_module, name)

            @torch.compiler.disable  # a graph break: logging runs eagerly, as Lightning wrote it
            def quiet(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if self._measuring:
                    return None
                return _original(*args, **kwargs)

            pl_module.__dict__[name] = quiet
            self._logging_installed.append(name)

    # --- the first batch -----------------------------------------------------------------
    def _optimize_first_batch(self, shell: ModuleShell, args: tuple, kwargs: dict) -> OptimizedModel | None:
        trainer = self._trainer
        assert trainer is not None
        optimizers = list(trainer.optimizers)
        optimizer = optimizers[0] if len(optimizers) == 1 else None
        self._measuring = True
        try:
            example = example_inputs_of(args, kwargs)
            options = {"steps": _stepping_batches(trainer), **self.options}  # the user's steps= wins
            result = rewriter.optimize(shell, example, optimizer=optimizer, **options)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            log.warning("rewriter: optimize() failed at the first batch, training the module as "
                        "it is: %s", self.error)
            return None
        finally:
            self._measuring = False
        if optimizer is not None:
            fast, switched = result
            if switched is not optimizer:
                # A fused replacement object (NPU, apex) shares the original's param_groups, so
                # the LR schedulers configured on the original still reach it.
                trainer.strategy.optimizers = [switched if o is optimizer else o for o in optimizers]
        else:
            fast = result
        self.report = fast.report
        log.info("%s", summary(fast.report))
        directory = self._report_directory(trainer)
        if directory is not None and trainer.is_global_zero:
            fast.report.save(directory)
            log.info("rewriter: report saved in %s", directory)
        return fast

    def _report_directory(self, trainer: Trainer) -> str | None:
        if self.report_dir is False:
            return None
        if self.report_dir not in (None, True):
            return os.fspath(self.report_dir)  # type: ignore[arg-type]
        return os.path.join(trainer.default_root_dir, "rewriter")


def _stepping_batches(trainer: Any) -> int | None:
    """Lightning's estimate of the optimizer steps of this fit (None: unknown or endless)."""
    try:
        n = trainer.estimated_stepping_batches
    except Exception:  # no datamodule length, an iterable dataset: Lightning cannot estimate
        return None
    return int(n) if isinstance(n, (int, float)) and math.isfinite(n) and n >= 1 else None
