"""Stage 2, decide: each candidate verified and measured against the original, kept or reverted.

Takes the user's step (:mod:`~rewriter.decide.job`) and the captured graphs; gives the kept
rewrites (:mod:`~rewriter.decide.kept`) with a decision per site or step. Per region signature:
:mod:`~rewriter.decide.regions` over :mod:`~rewriter.decide.site_gate`; on the whole step:
:mod:`~rewriter.decide.step`, :mod:`~rewriter.decide.optimizer_gate`,
:mod:`~rewriter.decide.compile_gate`; once at the end: :mod:`~rewriter.decide.confirm`. Under all
of them: paired timing (:mod:`~rewriter.decide.gate`), numerics (:mod:`~rewriter.decide.verify`
against :mod:`~rewriter.decide.reference`), peak memory (:mod:`~rewriter.decide.memory`), the
knowledge base and plan replay (:mod:`~rewriter.decide.knowledge`, :mod:`~rewriter.decide.replay`),
one-time costs weighed against the run's length (:mod:`~rewriter.decide.amortize`),
and the snapshot that leaves the user's state as it was (:mod:`~rewriter.decide.state`).
"""
