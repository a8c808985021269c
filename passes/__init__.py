"""Built-in rewrite passes, one per module, registered in the order optimize() tries them.

Users pick passes by name (``optimize(model, passes=["fuse_attention"])``); each module's
docstring says what it rewrites into what, when it is safe, its numeric contract and devices.
"""
from passes import fuse_linear, fuse_attention  # noqa: F401  (import registers)

__all__ = ["fuse_linear", "fuse_attention"]
