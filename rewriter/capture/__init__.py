"""Stage 1, capture: the user's model becomes graphs a pass can rewrite.

Takes the model and its example inputs; gives a :class:`~rewriter.capture.front_ends.Capture`
(fx or Dynamo graphs of the whole model, or one graph per repeated block class with
:mod:`~rewriter.capture.regional`), each in the normalised IR (:mod:`~rewriter.capture.ir`), and,
per site a pass finds, the region it replaces (:mod:`~rewriter.capture.region`) with the values
recorded at it (:mod:`~rewriter.capture.record`). :mod:`~rewriter.capture.install` puts a
decided block forward into every instance; :mod:`~rewriter.capture.graph_export` writes graphs
out as Python. :mod:`~rewriter.capture.choose` is the run's choice of front-end and its check.
"""
