"""Benchmark comparison runs: ``rewriter.optimize()`` beside eager, ``torch.compile`` and the
hand-tuned expert form, on a zoo of real models with random weights::

    python -m benchmarks.run --out benchmarks                      # the default run (training)
    python -m benchmarks.run --quick --models gpt2 --out /tmp/b    # tiny sizes, a smoke test

See ``benchmarks/README.md``.
"""
