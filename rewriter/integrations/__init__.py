"""One line for the trainers people already use; each is an optional extra.

* Hugging Face ``Trainer`` (``pip install 'rewriter[hf]'``)::

      from rewriter.integrations.transformers import RewriterCallback
      trainer = Trainer(model, args, train_dataset=ds, callbacks=[RewriterCallback()])

* Lightning (``pip install 'rewriter[lightning]'``)::

      from rewriter.integrations.lightning import RewriterCallback
      trainer = lightning.Trainer(max_steps=100, callbacks=[RewriterCallback()])

Both optimize at the first real training batch (its inputs are the example inputs), with the
optimizer the trainer built (switched to its fused form in place where torch allows), and from
then on route the trainer's own calls through the rewritten graphs. Nothing else about the
trainer changes: it still owns the loop, the scheduler, the wrapping for distributed runs and
the checkpoints (which keep the model's own keys and load into the plain model class).

Importing ``rewriter`` never imports these frameworks; importing an integration without its
framework raises an ``ImportError`` that names the extra to install.
"""
from __future__ import annotations

__all__: list[str] = []
