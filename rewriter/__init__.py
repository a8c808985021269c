"""rewriter: rewrite a PyTorch model, keep only what measures faster and matches numerically.

    import rewriter
    fast = rewriter.optimize(model, example_inputs=(x,))
    print(fast.report)
"""
from rewriter.api import optimize, restore
from rewriter.capture.graph_export import load_exported
from rewriter.decide.gate import GateSettings
from rewriter.devices import amp
from rewriter.devices.backends import Backend, get_backend
from rewriter.devices.host import bind_cores
from rewriter.devices.host_memory import keep_freed_host_memory
from rewriter.devices.optimizers import clip_grad_norm_, zero_grad
from rewriter.errors import (
    CaptureError,
    PassError,
    PlanError,
    RewriterError,
    VerificationError,
)
from rewriter.pass_api import Pass, PassContext, Site, register_pass, registered_passes
from rewriter.report import Decision, Report
from rewriter.wrapper import OptimizedModel

__version__ = "0.1.0"

__all__ = [
    # entry point and its result
    "optimize", "OptimizedModel", "Report", "Decision", "restore",
    # the offline script's written graphs, loaded onto a model (graphs/optimized_model.py)
    "load_exported",
    # bringing your own pass
    "Pass", "PassContext", "Site", "register_pass", "registered_passes",
    # the gradient step and mixed precision (amp.register_half_function, ...)
    "clip_grad_norm_", "zero_grad", "amp",
    # devices and measuring
    "Backend", "get_backend", "GateSettings", "bind_cores", "keep_freed_host_memory",
    # errors
    "RewriterError", "CaptureError", "PassError", "PlanError", "VerificationError",
]
