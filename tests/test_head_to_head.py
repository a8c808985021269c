"""benchmarks.head_to_head's table: ours against each peer, and a model whose process failed."""
import pytest

from benchmarks.head_to_head import markdown, over_processes, parse_args

MACHINE = {"cpu": "AMD EPYC", "cpu_count": 2, "torch": "2.13.0+cpu", "date": "2026-12-07"}


def test_the_table_gives_ours_over_each_peer_and_says_which_model_failed():
    results = [{"model": "llama", "ours": "optimize_steps20k", "kept": ["kept: fuse_attention"],
                "rows": [{"peer": "compile", "speedup": 1.0873, "noise": 0.0213, "pairs": 10,
                          "peer_ms": 279.5, "ours_ms": 257.1, "peer_fresh_pages": 8000.0,
                          "ours_fresh_pages": 0.0},
                         {"peer": "expert", "speedup": 1.1, "noise": 0.01, "pairs": 10,
                          "peer_ms": 280.0, "ours_ms": 254.5}]},
               {"model": "gpt2", "ours": "optimize_steps20k", "error": "RuntimeError: out of memory"}]
    text = markdown(results, "python -m benchmarks.head_to_head", MACHINE)
    assert "| llama | optimize(steps=20000) | torch.compile | **1.09x** ±0.02 | 10 | 279.5 | 257.1 | 8000 / 0 |" in text
    assert "| llama | optimize(steps=20000) | expert | **1.10x** ±0.01 | 10 | 280.0 | 254.5 | - / - |" in text  # not counted
    assert "| gpt2 | optimize(steps=20000) | - | failed: RuntimeError: out of memory |" in text


def test_the_defaults_are_the_five_in_fp32_against_both_peers():
    args = parse_args([])
    assert args.ours == "optimize_steps20k" and args.peers == ["compile", "expert"]
    assert args.models == ["llama", "gpt2", "bert", "qwen2", "distilbert"]
    assert args.seconds is None and args.repeat == 1  # BENCH_GATE's budget, one process a model
    with pytest.raises(SystemExit):  # argparse's error, before any process is started
        parse_args(["--repeat", "0"])


def test_a_budget_given_reaches_the_child_process(monkeypatch):
    import benchmarks.measure
    from benchmarks.head_to_head import in_its_own_process
    seen = {}
    monkeypatch.setattr(benchmarks.measure, "result_in_fresh_process",
                        lambda cmd, failed, knowledge_base: seen.setdefault("cmd", cmd) and {})
    in_its_own_process("llama", "optimize_steps20k", ["compile"], False, seconds=15.0)
    assert seen["cmd"][-2:] == ["--seconds", "15.0"]
    assert parse_args(["--seconds", "15"]).seconds == 15.0


def _round(process, speedup):
    return {"model": "llama", "ours": "optimize_steps20k", "kept": [], "process": process,
            "rows": [{"peer": "compile", "speedup": speedup, "noise": 0.02, "pairs": 10,
                      "peer_ms": 250.0, "ours_ms": 250.0 / speedup}]}


def test_over_processes_the_median_and_range_of_each_peer_and_a_failed_process_left_out():
    rounds = [_round(1, 1.06), _round(2, 0.95), {"model": "llama", "ours": "optimize_steps20k",
                                                  "process": 3, "error": "killed"}, _round(4, 1.01)]
    (compile_row,) = over_processes(rounds)
    assert compile_row == {"peer": "compile", "median": 1.01, "low": 0.95, "high": 1.06, "processes": 3}
    summary = [{"model": "llama", "ours": "optimize_steps20k", "peers": [compile_row]}]
    text = markdown(rounds, "python -m benchmarks.head_to_head --repeat 4", MACHINE, summary)
    assert "| llama, process 2 | optimize(steps=20000) | torch.compile | **0.95x** ±0.02 |" in text
    assert "| llama, process 3 | optimize(steps=20000) | - | failed: killed |" in text
    assert "| llama | optimize(steps=20000) | torch.compile | **1.01x** (0.95-1.06) | 3 |" in text


def test_a_child_that_crashed_is_reported_by_its_signal_and_crashing_frame():
    """A segfault leaves no exception: the table names the signal, faulthandler's verdict and
    the innermost frame of the crashing thread (an Inductor kernel's wrapper, T5, stop 65)."""
    import sys

    from benchmarks.measure import error_line, result_in_fresh_process
    crash = ("import faulthandler, os, signal; faulthandler.enable()\n"
             "def kernel_call():\n    os.kill(os.getpid(), signal.SIGABRT)\nkernel_call()\n")
    r = result_in_fresh_process([sys.executable, "-c", crash], {"model": "t5"})
    assert r["model"] == "t5" and r["error"].startswith("killed by SIGABRT")
    line = error_line(r["error"])
    assert line.startswith("killed by SIGABRT; Fatal Python error: Aborted") and "kernel_call" in line, line
    assert error_line("exit status 1\nTraceback ...\nValueError: bad") == "ValueError: bad"
