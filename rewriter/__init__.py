"""rewriter: rewrite a PyTorch model, keep only what measures faster and matches numerically.

    import rewriter
    fast = rewriter.optimize(model, example_inputs=(x,))
    print(fast.report)
"""
from rewriter.api import optimize
from rewriter.backends import Backend, get_backend
from rewriter.errors import CaptureError, PassError, PlanError, RewriterError, VerificationError
from rewriter.gate import GateSettings
from rewriter.optimizers import clip_grad_norm_, zero_grad
from rewriter.pass_api import Pass, PassContext, Site, register_pass, registered_passes
from rewriter.report import Decision, Report
from rewriter.wrapper import OptimizedModel

__version__ = "0.1.0"

__all__ = [
    # entry point and its result
    "optimize", "OptimizedModel", "Report", "Decision",
    # bringing your own pass
    "Pass", "PassContext", "Site", "register_pass", "registered_passes",
    # the gradient step
    "clip_grad_norm_", "zero_grad",
    # devices and measuring
    "Backend", "get_backend", "GateSettings",
    # errors
    "RewriterError", "CaptureError", "PassError", "PlanError", "VerificationError",
]
