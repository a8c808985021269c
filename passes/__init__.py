"""Built-in rewrite passes, one per module, registered in the order optimize() tries them.

Users pick passes by name (``optimize(model, passes=["fuse_attention"])``); each module's
docstring says what it rewrites into what, when it is safe, its numeric contract and devices.
``passes/README.md`` has the table.

The order matters where one rewrite exposes or hides another: projections are merged first,
then attention (its softmax must still be there), then norms and activations, then a scale
moved off a Linear's wide output (before the passes that take a bare LM head: the fused losses,
the kept output buffer), then the layout and matmul forms.
"""
import importlib

# The order optimize() tries the passes in (each module registers its pass when imported).
PASS_MODULES = (
    "fuse_qkv_projections",
    "fuse_attention",
    "fuse_rms_norm",
    "fuse_layer_norm",
    "fuse_gelu",
    "fuse_swiglu",
    "fuse_rotary_embedding",
    "fold_output_scale",
    "fuse_linear_cross_entropy",
    "fuse_cross_entropy",
    "fuse_one_hot",
    "fuse_linear",
    "onednn_linear",
    "reuse_linear_output",
    "fuse_confusion_transpose",
    "fold_batch_norm",
    "narrow_int64",
    "make_contiguous",
    "pad_to_alignment",
    "to_channels_last",
    "cast_to_half",
)
for _module in PASS_MODULES:
    importlib.import_module(f"passes.{_module}")

__all__ = list(PASS_MODULES)
