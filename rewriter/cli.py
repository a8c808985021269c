"""The ``rewriter`` command line.

    rewriter demo [--out DIR]        optimize the built-in example and print the report
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def _demo(args: argparse.Namespace) -> int:
    import rewriter
    from rewriter.examples import tuned_block

    model, inputs = tuned_block()
    print(f"rewriter demo: {type(model).__name__} on {inputs[0].shape[0]}x{inputs[0].shape[1]} "
          f"tokens, inference, torch {torch.__version__}, cpu threads {torch.get_num_threads()}",
          file=sys.stderr)
    fast = rewriter.optimize(model, example_inputs=inputs)
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    print(fast.report.to_markdown())
    if args.out:
        fast.report.save(args.out)
        print(f"report and plan written to {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rewriter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="optimize the built-in example and print the report")
    demo.add_argument("--out", help="also write report.json, report.md and plan.json here")
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
