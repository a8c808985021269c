"""Stage 3, profile: where the time goes, before and after, in terms a person acts on.

Takes a torch or torch_npu profile (or a run to profile); gives operator and kernel rows
(:mod:`~rewriter.profile.rows`), each operator against the device's roofs
(:mod:`~rewriter.profile.roofline`, :mod:`~rewriter.profile.peaks`, :mod:`~rewriter.profile.opcost`),
the model line it came from (:mod:`~rewriter.profile.attribution`), the case study's per-operator
analysis (:mod:`~rewriter.profile.op_analysis`, :mod:`~rewriter.profile.shape_outliers`), before/after
comparison (:mod:`~rewriter.profile.compare`) and the advisor's hot spots naming a pass
(:mod:`~rewriter.profile.advisor`). The public surface is :mod:`rewriter.profiling`.
"""
