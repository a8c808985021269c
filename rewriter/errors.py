"""Exceptions raised by rewriter. Bad user input raises ``ValueError``/``TypeError`` subclasses."""
from __future__ import annotations


class RewriterError(Exception):
    """Base of the errors rewriter raises on its own account."""


class CaptureError(RewriterError):
    """No front-end could capture the model as graphs."""


class PassError(RewriterError):
    """A pass met a graph it cannot rewrite. The pipeline reverts the pass and reports this."""


class VerificationError(RewriterError):
    """A candidate's outputs or gradients differ from the original model's."""


class PlanError(RewriterError, ValueError):
    """A plan file is corrupt, truncated, or of an unknown format."""
