"""``rewriter optimize``: the offline script end to end, with the gate's clock controlled.

The clock makes ``fuse_attention`` twice as fast and everything else no faster, so decisions are
fixed; timings belong in benchmarks. Each run checks what it wrote.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import sys
import textwrap

import pytest
import torch

from rewriter import cli
from rewriter.capture import graph_export
from tests.controlled import QUICK, ControlledClock
from tests.factories import tiny_models

FACTORIES = "tests/factories/tiny_models.py"
PASSES = ("--passes", "fuse_attention,fuse_linear")
QUICK_RUN = (*PASSES, "--no-traces")  # for tests about something other than the traces


@pytest.fixture
def clocks(monkeypatch):
    """Every clock the script asks for, in order (none: it never got as far as measuring)."""
    made: list[ControlledClock] = []

    def make() -> ControlledClock:
        made.append(ControlledClock({"fuse_attention": 0.5}))
        return made[-1]
    monkeypatch.setattr(cli, "_make_clock", make)
    monkeypatch.setattr(cli, "_gate_settings", lambda args: QUICK)
    return made


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["optimize", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def files_under(directory) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), directory)
                  for d, _, names in os.walk(directory) for f in names)


def trace_op_names(path) -> set[str]:
    with open(path) as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_transformers_training_writes_everything_and_its_plan_replays(tmp_path, clocks, capsys):
    pytest.importorskip("transformers")
    spec = "tests/factories/tiny_gpt2.py:gpt2_train"
    out = tmp_path / "measured"
    # No optimizer: its gating is covered elsewhere, and this is the slowest test.
    train = ("--train", "--optimizer", "none", *PASSES)
    code, stdout, stderr = run(capsys, spec, *train, "--out", str(out))
    assert code == 0, stderr

    written = files_under(out)
    assert {"plan.json", "report.json", "report.md", "traces/compare/comparison.md"} <= set(written)
    for variant in ("eager", "optimized"):  # Chrome trace, TensorBoard trace, table
        assert {f"traces/{variant}/trace.json", f"traces/{variant}/operators.md"} <= set(written)
        assert any(f.startswith(f"traces/{variant}/tensorboard/") for f in written)
    graphs = [f for f in written if f.startswith("graphs/")]
    # Regional capture: the outer graphs and the decoder block's graph (GPT2Block is one of
    # the model's _no_split_modules: a block even where there is only one).
    assert "graphs/GPT2Block.graph_0.py" in graphs and "graphs/graph_0.py" in graphs
    assert all(f.endswith(".py") for f in graphs)
    assert not [f for f in written if f.endswith((".pt", ".pth", ".pkl", ".bin"))]
    assert any("scaled_dot_product_attention" in (out / g).read_text() for g in graphs)

    plan = json.loads((out / "plan.json").read_text())
    assert plan["kept_passes"] == ["fuse_attention"]
    assert plan["fingerprint"]["mode"] == "training" and plan["fingerprint"]["front_end"] == "regional"
    report = json.loads((out / "report.json").read_text())
    assert report["kept_passes"] == ["fuse_attention"] and report["model"] == "GPT2LMHeadModel"
    assert report["top_ops_before"] and any("graph code" in n for n in report["notes"])
    assert (out / "report.md").read_text().startswith("# rewriter report: GPT2LMHeadModel")
    # The traces show the rewrite: fused attention appears only after.
    fused = lambda names: any("scaled_dot_product" in n for n in names)  # noqa: E731
    assert not fused(trace_op_names(out / "traces/eager/trace.json"))
    assert fused(trace_op_names(out / "traces/optimized/trace.json"))
    # Progress while measuring, a summary table at the end.
    assert "[1/2] fuse_attention: kept" in stderr
    assert "fuse_attention" in stdout and "whole model: optimized model" in stdout

    replay_out = tmp_path / "replayed"
    code, stdout, stderr = run(capsys, spec, *train, "--plan", str(out / "plan.json"),
                               "--out", str(replay_out))
    assert code == 0, stderr
    replayed = json.loads((replay_out / "report.json").read_text())
    assert [d["status"] for d in replayed["decisions"]] == ["replayed"]
    assert replayed["kept_passes"] == ["fuse_attention"]
    assert clocks[-1].calls == 0  # nothing measured
    assert "replayed ['fuse_attention'] without measuring" in stdout


def test_fx_capture_writes_a_module_that_runs_on_the_original_parameters(tmp_path, clocks, capsys):
    out = tmp_path / "out"
    code, stdout, stderr = run(capsys, f"{FACTORIES}:attention_block", "--out", str(out), *PASSES)
    assert code == 0, stderr
    written = files_under(out)
    assert "graphs/optimized_model.py" in written
    # Weights are never written; only the traced mask constant, as raw bytes.
    assert [f for f in written if not f.endswith((".py", ".json", ".md", ".png"))] == [
        "graphs/optimized_model_constants/_tensor_constant0.bin"]
    source = (out / "graphs/optimized_model.py").read_text()
    assert "scaled_dot_product_attention" in source and "softmax" not in source
    assert "from rewriter import load_exported" in source  # its usage names the public import

    # A freshly built model with other weights: the module must compute with THOSE weights.
    model = tiny_models.AttentionBlock().eval()
    x = torch.randn(2, 16, 32)
    rewritten = graph_export.load_exported(out / "graphs/optimized_model.py").load(model)
    assert list(rewritten.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(rewritten.parameters(), model.parameters()))
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), model(x), rtol=1e-4, atol=1e-5)
    report = json.loads((out / "report.json").read_text())
    assert any("loaded back and checked" in n for n in report["notes"])


def test_steps_reach_the_compile_decision_and_a_bad_count_is_refused(tmp_path, clocks, capsys):
    out = tmp_path / "out"
    code, _, stderr = run(capsys, f"{FACTORIES}:attention_block", "--out", str(out), *PASSES,
                          "--steps", "50")
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    row = next(d for d in report["decisions"] if d["pass_name"] == "compile")
    assert row["status"] == "not tried" and row["measurement"]["steps"] == 50
    with pytest.raises(SystemExit) as bad:
        run(capsys, f"{FACTORIES}:attention_block", "--out", str(out), "--steps", "0")
    assert bad.value.code == 2 and "positive integer" in capsys.readouterr().err


def test_corrupt_plan_fails_naming_the_file_before_anything_runs(tmp_path, clocks, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text('{"format": "rewriter-plan/1", "kept_pa')
    code, _, stderr = run(capsys, f"{FACTORIES}:attention_block", "--plan", str(plan),
                          "--out", str(tmp_path / "out"))
    assert code == 2
    assert str(plan) in stderr and "not valid JSON" in stderr
    assert clocks == [] and not (tmp_path / "out" / "report.json").exists()


def test_plan_for_other_shapes_is_reported_and_not_applied(tmp_path, clocks, capsys):
    first = tmp_path / "batch2"
    assert run(capsys, f"{FACTORIES}:attention_block", "--out", str(first), *QUICK_RUN)[0] == 0
    code, stdout, stderr = run(capsys, f"{FACTORIES}:attention_block_batch3",
                               "--plan", str(first / "plan.json"), "--out", str(tmp_path / "b3"),
                               *QUICK_RUN)
    assert code == 0, stderr
    report = json.loads((tmp_path / "b3" / "report.json").read_text())
    assert report["plan_status"].startswith("not applied, fingerprint differs (inputs:")
    assert "replayed" not in {d["status"] for d in report["decisions"]}
    assert clocks[-1].calls > 0  # measured instead
    assert "plan: not applied, fingerprint differs" in stdout


def test_unwritable_output_fails_before_the_factory_is_imported(tmp_path, clocks, capsys):
    marker = tmp_path / "imported"
    (tmp_path / "model.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                       "def build():\n    raise AssertionError('called')\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, _, stderr = run(capsys, f"{tmp_path}/model.py:build", "--out", str(blocker / "out"))
    assert code == 2 and "is not writable" in stderr and str(blocker / "out") in stderr
    assert not marker.exists() and clocks == []


def test_only_the_named_factory_runs_and_nothing_is_unpickled(tmp_path, clocks, capsys, monkeypatch):
    log = tmp_path / "ran.txt"
    (tmp_path / "user_model.py").write_text(textwrap.dedent(f"""
        def _log(what):
            with open({str(log)!r}, "a") as f:
                f.write(what + "\\n")

        _log("import")

        def build():
            _log("build")
            from tests.factories.tiny_models import attention_block
            return attention_block()

        def other():
            _log("other")

        if __name__ == "__main__":
            _log("main")
    """))

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")
    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    spec = f"{tmp_path}/user_model.py:build"
    assert run(capsys, spec, "--out", str(tmp_path / "a"), *QUICK_RUN)[0] == 0
    code, _, stderr = run(capsys, spec, "--plan", str(tmp_path / "a" / "plan.json"),
                          "--out", str(tmp_path / "b"), *QUICK_RUN)
    assert code == 0, stderr
    assert log.read_text().split() == ["import", "build", "build"]


def test_decision_cache_makes_the_second_run_replay(tmp_path, clocks, capsys):
    cache = tmp_path / "cache"
    for name in ("first", "second"):
        code, _, stderr = run(capsys, f"{FACTORIES}:attention_block", "--cache-dir", str(cache),
                              "--out", str(tmp_path / name), *QUICK_RUN)
        assert code == 0, stderr
    second = json.loads((tmp_path / "second" / "report.json").read_text())
    assert "decision cache" in second["plan_status"] and clocks[-1].calls == 0
    assert clocks[0].calls > 0


@pytest.mark.parametrize("spec, message", [
    (f"{FACTORIES}", "has no ':'"),
    (f"{FACTORIES}:no_such_factory", f"{FACTORIES}.*no attribute 'no_such_factory'"),
    (f"{FACTORIES}:model_only", "--input"),
])
def test_bad_spec_exits_2_naming_the_problem(tmp_path, clocks, capsys, spec, message):
    code, _, stderr = run(capsys, spec, "--out", str(tmp_path))
    assert code == 2 and clocks == []
    assert re.search(message, stderr), stderr


def test_model_only_factory_with_input_specs_and_a_training_loss(tmp_path, clocks, capsys):
    tiny_models.LOSS_CALLS[0] = 0
    code, _, stderr = run(capsys, f"{FACTORIES}:model_only", "--input", "2x16x32", "--train",
                          "--loss", "tests.factories.tiny_models:counting_loss",
                          "--optimizer", "sgd", "--out", str(tmp_path), *QUICK_RUN)
    assert code == 0, stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "training" and report["kept_passes"] == ["fuse_attention"]
    assert tiny_models.LOSS_CALLS[0] > 0  # the named loss, not the default cotangent
    source = (tmp_path / "graphs" / "optimized_model.py").read_text()
    assert "self.training = True" in source


def test_bind_cores_is_applied_and_reported(tmp_path, clocks, capsys):
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        code, stdout, stderr = run(capsys, f"{FACTORIES}:attention_block", "--bind-cores",
                                   "--out", str(tmp_path), *QUICK_RUN)
    finally:  # the script bound this test process: put it back
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    assert code == 0, stderr
    assert "host: cores: bound to NUMA node" in stdout
    notes = json.loads((tmp_path / "report.json").read_text())["notes"]
    assert any(n.startswith("host: cores: bound to NUMA node") for n in notes)


def test_aoe_dumps_exactly_one_step_last_and_prints_the_command(tmp_path, clocks, capsys,
                                                                fake_torch_npu, monkeypatch):
    out, dump = tmp_path / "out", tmp_path / "aoe"
    at_set_aoe = {}
    real_set_aoe = fake_torch_npu.npu.set_aoe

    def set_aoe(path):  # what had happened when dumping was switched on
        at_set_aoe.update(clock_calls=clocks[-1].calls,
                          profiler_on=torch.autograd.profiler._is_profiler_enabled,
                          traced=(out / "traces" / "optimized" / "trace.json").exists())
        real_set_aoe(path)
    monkeypatch.setattr(fake_torch_npu.npu, "set_aoe", set_aoe)
    monkeypatch.setattr(fake_torch_npu.npu, "aoe_dump_paths", [])
    steps_while_dumping = []
    real_step = cli._step

    def counted_step(*args, **kwargs):
        step = real_step(*args, **kwargs)

        def run_step() -> None:
            if fake_torch_npu.npu.aoe_dump_paths:
                steps_while_dumping.append(1)
            step()
        return run_step
    monkeypatch.setattr(cli, "_step", counted_step)
    code, stdout, stderr = run(capsys, f"{FACTORIES}:attention_block", "--aoe", str(dump),
                               "--out", str(out), *PASSES)
    assert code == 0, stderr
    assert fake_torch_npu.npu.aoe_dump_paths == [str(dump)] and dump.is_dir()
    assert steps_while_dumping == [1]  # one step with dumping on
    # Dumping came last: after measuring (no clock call since) and profiling, none running.
    assert at_set_aoe == {"clock_calls": clocks[-1].calls, "profiler_on": False, "traced": True}
    assert f"aoe --job_type=2 --model_path={dump}" in stdout
    notes = json.loads((out / "report.json").read_text())["notes"]
    assert any("AOE: one step dumped" in n for n in notes)


@pytest.mark.parametrize("extra, message", [((), "needs torch_npu"),
                                            (("--bind-cores",), "not to bind CPUs")])
def test_aoe_refused_before_measuring(tmp_path, clocks, capsys, monkeypatch, extra, message):
    if not extra:
        monkeypatch.setattr("rewriter.devices.host.import_torch_npu", lambda: None)
    else:
        from tests import npu_shim
        monkeypatch.setitem(sys.modules, "torch_npu", npu_shim.as_module())
    code, _, stderr = run(capsys, f"{FACTORIES}:attention_block", "--aoe", str(tmp_path / "aoe"),
                          *extra, "--out", str(tmp_path / "out"))
    assert code == 2 and message in stderr and clocks == []


def test_profile_subcommand_writes_trace_and_table(tmp_path, capsys):
    code = cli.main(["profile", f"{FACTORIES}:attention_block", "--steps", "1", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "## Operators: AttentionBlock inference step (cpu)" in captured.out
    assert "Unfused attention" in captured.out  # the advisor reads the table
    written = files_under(tmp_path)
    assert {"trace.json", "operators.md", "operators.json"} <= set(written)
    assert "aten::_softmax" in trace_op_names(tmp_path / "trace.json")


def test_exported_module_inlines_small_constants_and_moves_them_with_the_model(tmp_path):
    import rewriter

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):  # the tensor is made while tracing: a baked-in constant
            return self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])

    model, x = Scaled().eval(), torch.randn(3, 4)
    fast = rewriter.optimize(model, (x,), passes=[], front_end="fx", progress=False, profile=False)
    export = graph_export.write_graph_code(fast, tmp_path)
    source = (tmp_path / graph_export.MODULE_FILE).read_text()
    assert export.loadable and "_torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=_torch.float32)" in source
    rewritten = graph_export.load_exported(export.loadable).load(model)
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), model(x))
        rewritten.double()  # the shared parameters and the constant both become float64
        assert rewritten(x.double()).dtype == torch.float64
