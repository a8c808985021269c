"""Run a function on several CPU processes, as ``torchrun`` would, and collect what each wrote.

    results = run_ranks(_train_and_report, tmp_path, world=2, join_seconds=120)

``fn(rank, port, out_dir)`` must be a module-level function (the processes are spawned, so it
is pickled by name) that writes ``rank{rank}.json`` into ``out_dir``.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable[[int, int, str], None], port: int, out_dir: str) -> None:
    fn(rank, port, out_dir)
    # Leave without interpreter finalization. With gloo, tearing down the interpreter while the
    # process group's C++ worker threads still hold work objects (DDP's reducer keeps some)
    # aborts the process ("terminate called without an active exception", SIGABRT) after the
    # rank has finished and written its result; torch has no fix for it yet (pytorch#179291
    # was abandoned). An exception in ``fn`` still propagates and fails the rank as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[[int, int, str], None], out_dir: "str | Path", *, world: int,
              join_seconds: float) -> list[dict]:
    """Spawn ``world`` ranks of ``fn``; a hung collective fails the test after ``join_seconds``."""
    context = mp.start_processes(_rank_main, args=(fn, free_port(), str(out_dir)), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + join_seconds
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not finish within {join_seconds} s (hung collective?)")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
