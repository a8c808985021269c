"""benchmarks/gpu_check.py: skips cleanly without CUDA; its table has the documented layout."""
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run")
def test_gpu_check_skips_cleanly_without_cuda(capsys):
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == "gpu_check skipped: no CUDA device"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "skipped: no CUDA device" in done.stdout, done.stderr


def test_the_table_has_the_documented_layout():
    rows = [{"check": "device", "result": "NVIDIA H200", "figure": "torch 2.x, triton yes"},
            {"check": "compile (bf16+compile)", "result": "kept", "figure": "1.300x ±0.010",
             "detail": "inductor, whole step: faster | a\nb"}]
    assert gpu_check.table(rows).splitlines() == [
        "| check | result | figure | detail |",
        "|---|---|---|---|",
        "| device | NVIDIA H200 | torch 2.x, triton yes |  |",
        "| compile (bf16+compile) | kept | 1.300x ±0.010 | inductor, whole step: faster \\| a b |",
    ]
