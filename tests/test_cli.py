import json

import torch

from rewriter import cli


def test_demo_runs_and_writes_report(tmp_path, capsys, monkeypatch):
    from rewriter import examples
    small = lambda: (examples.TunedBlock(in_features=64, hidden=32, max_len=16).eval(),  # noqa: E731
                     (torch.randn(2, 16, 64),))
    monkeypatch.setattr(examples, "tuned_block", small)
    assert cli.main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "# rewriter report: TunedBlock" in out and "fuse_attention" in out
    report = json.loads((tmp_path / "report.json").read_text())
    sites = {d["pass_name"]: len(d["sites"]) for d in report["decisions"]}
    assert sites["fuse_linear"] == 1 and sites["fuse_attention"] == 1
    assert (tmp_path / "plan.json").exists()


def test_demo_generate_serves_the_original_tokens_and_names_the_graphs_that_ran(capsys, monkeypatch):
    import pytest
    pytest.importorskip("transformers")
    from rewriter import examples
    real = examples.tiny_causal_lm
    monkeypatch.setattr(examples, "tiny_causal_lm", lambda: real(layers=2, hidden=48, prompt=8))
    monkeypatch.setenv("REWRITER_KNOWLEDGE_BASE", "off")
    from tests.controlled import ControlledClock
    from tests.test_transformers import ALL_FASTER
    monkeypatch.setattr(cli, "_make_clock", lambda: ControlledClock(ALL_FASTER))  # every pass kept
    assert cli.main(["demo", "--generate"]) == 0  # 1 when the tokens differ from the original's
    out = capsys.readouterr().out
    assert "# rewriter report: Qwen2ForCausalLM" in out and "- step: generate: a prefill of 1x8" in out
    assert "tokens identical to the original model's: True" in out
    ran = out.split("graphs that ran in one generate(): ")[1]
    assert "Qwen2DecoderLayer.graph_" in ran and "rewritten" in ran


def test_help_lists_the_subcommands(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert all(name in out for name in ("demo", "optimize", "profile"))
    assert "package.module:factory" in out  # the SPEC forms are explained


def test_python_dash_m_runs_the_same_command_line():
    # ``python -m rewriter.cli`` runs the module as a script: everything main() uses must be
    # defined before its ``__main__`` guard
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rewriter.cli", "optimize", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--steps N" in done.stdout
