"""optimize() as a user calls it: inputs, laziness, state_dict, reports, plans, bad input."""
import json

import pytest
import torch
import torch.nn as nn

import rewriter
from rewriter.errors import PlanError
from tests.controlled import QUICK, ControlledClock, RewriteRelu
from tests.models import HandAttention, ReluMLP, TwoLayers

FAST = {"fuse_attention": 0.5, "fuse_linear": 0.5, "a": 0.5}


def _opt(model, inputs=None, **kw):
    kw.setdefault("clock", ControlledClock(FAST))
    return rewriter.optimize(model, inputs, gate=QUICK, progress=False, profile=False, **kw)


@pytest.fixture
def attn():
    torch.manual_seed(0)
    return HandAttention("mul").eval(), torch.randn(2, 16, 32)


def test_inference_returns_drop_in_module(attn):
    model, x = attn
    fast = _opt(model, (x,))
    assert isinstance(fast, nn.Module) and fast.report.kept_passes == ["fuse_attention"]
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    assert fast.original is model


def test_no_inputs_optimizes_at_the_first_call(attn):
    model, x = attn
    fast = _opt(model)
    assert fast.report is None and "first call" in repr(fast)
    with torch.no_grad():
        out = fast(x)
    assert fast.report is not None and fast.report.kept_passes == ["fuse_attention"]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


def test_state_dict_has_original_keys_and_loads_both_ways(attn):
    model, x = attn
    fast = _opt(model, (x,))
    assert list(fast.state_dict()) == list(model.state_dict())
    fresh = HandAttention("mul")
    fresh.load_state_dict(fast.state_dict())
    fast.load_state_dict(fresh.state_dict())
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_training_with_optimizer_returns_pair_and_trains(attn):
    model, x = attn
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, opt2 = _opt(model, (x,), optimizer=opt, loss_fn=lambda out: out.pow(2).mean())
    assert opt2 is opt and fast.report.mode == "training"
    before = model.qkv.weight.detach().clone()
    fast(x).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(before, model.qkv.weight)


def test_fx_capture_retraces_on_train_eval_switch():
    torch.manual_seed(0)
    model = HandAttention("mul", dropout=0.5).train()
    x = torch.randn(2, 16, 32)
    fast = _opt(model, (x,))
    assert fast.report.front_end == "fx" and fast.report.kept_passes == ["fuse_attention"]
    fast.eval()
    assert not model.training
    with torch.no_grad():  # eval: no dropout, so the outputs must match exactly
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    assert "dropout_p = 0.0" in fast._fx_by_mode[False].graph_code()["graph_0"]


def test_report_dict_markdown_and_save(tmp_path, attn):
    model, x = attn
    fast = rewriter.optimize(model, (x,), gate=QUICK, progress=False,
                             clock=ControlledClock(FAST))
    r = fast.report
    d = r.to_dict()
    assert d["kept_passes"] == ["fuse_attention"] and d["front_end"] == "fx"
    assert {"pass_name", "kept", "speedup", "reason", "sites", "max_abs_error"} <= set(d["decisions"][0])
    assert r.top_ops_before and r.top_ops_after  # one profiler run per variant
    md = r.to_markdown()
    assert "| fuse_attention | kept |" in md and "Top operators before" in md
    r.save(tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["model"] == "HandAttention"
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["kept_passes"] == ["fuse_attention"]


def test_plan_replays_without_measuring(tmp_path, attn):
    model, x = attn
    _opt(model, (x,)).report.save(tmp_path)
    clock = ControlledClock(FAST)
    replayed = _opt(model, (x,), plan=str(tmp_path / "plan.json"), clock=clock)
    assert clock.calls == 0
    assert replayed.report.kept_passes == ["fuse_attention"]
    assert replayed.report.decisions[0].status == "replayed"


def test_plan_with_other_fingerprint_is_not_applied_blindly(tmp_path, attn):
    model, x = attn
    _opt(model, (x,)).report.save(tmp_path)
    other = _opt(model, (torch.randn(3, 16, 32),), plan=str(tmp_path / "plan.json"))
    assert "not applied" in other.report.plan_status and "inputs" in other.report.plan_status
    measured = {d.pass_name: d.status for d in other.report.decisions}
    assert measured["fuse_attention"] == "kept"  # measured instead of replayed


def test_a_plan_is_not_replayed_on_a_model_with_the_same_ops_and_other_widths(tmp_path):
    x = torch.randn(8, 16)
    _opt(TwoLayers(32).eval(), (x,), passes=[]).report.save(tmp_path)
    other = _opt(TwoLayers(64).eval(), (x,), passes=[], plan=str(tmp_path / "plan.json"))
    assert "not applied" in other.report.plan_status and "tensors" in other.report.plan_status
    same = _opt(TwoLayers(32).eval(), (x,), passes=[], plan=str(tmp_path / "plan.json"))
    assert "not applied" not in (same.report.plan_status or "")


@pytest.mark.parametrize("content", ["{not json", '{"format": "something else"}', ""])
def test_corrupt_plan_error_names_the_file(tmp_path, attn, content):
    model, x = attn
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlanError, match="plan.json"):
        _opt(model, (x,), plan=str(path))


def test_not_a_module_is_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        rewriter.optimize(lambda x: x, (torch.randn(2),))


def test_inputs_the_model_cannot_run_keep_the_model_error_as_cause():
    model = ReluMLP(16)
    with pytest.raises(ValueError, match="cannot run on the example inputs") as info:
        _opt(model, (torch.randn(4, 7),))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_unknown_pass_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'.*fuse_attention"):
        rewriter.optimize(ReluMLP(), (torch.randn(2, 16),), passes=["fuse_everything"])
    with pytest.raises(ValueError, match="exclude names unknown pass"):
        rewriter.optimize(ReluMLP(), (torch.randn(2, 16),), exclude=["nope"])


def test_bad_options_are_refused():
    m, x = ReluMLP(), (torch.randn(2, 16),)
    with pytest.raises(ValueError, match="dtype"):
        rewriter.optimize(m, x, dtype=torch.int8)
    with pytest.raises(ValueError, match="min_speedup"):
        rewriter.optimize(m, x, min_speedup=0.5)
    with pytest.raises(TypeError, match="example_inputs"):
        rewriter.optimize(m, 3)
    with pytest.raises(ValueError, match="unknown device"):
        rewriter.optimize(m, x, device="tpu")
    with pytest.raises(ValueError, match="already returned by optimize"):
        rewriter.optimize(_opt(m, x), x)


def test_optimizer_over_foreign_tensors_is_refused():
    m = ReluMLP()
    opt = torch.optim.SGD([nn.Parameter(torch.randn(3))], lr=0.1)
    with pytest.raises(ValueError, match="not parameters of the model"):
        rewriter.optimize(m, (torch.randn(2, 16),), optimizer=opt)


def test_keyword_inputs(attn):
    model, x = attn
    fast = _opt(model, {"x": x})
    with torch.no_grad():
        torch.testing.assert_close(fast(x=x), model(x=x), rtol=1e-5, atol=1e-6)


def test_reduced_pass_needs_dtype(attn):
    model, x = attn

    class Lossy(RewriteRelu):
        contract = "reduced"
    fast = _opt(model, (x,), passes=[Lossy("lossy")])
    d = fast.report.decisions[0]
    assert d.status == "not applicable" and "dtype" in d.reason


def test_decision_cache_makes_the_second_optimize_replay(tmp_path, attn):
    model, x = attn
    first = _opt(model, (x,), cache_dir=str(tmp_path))
    assert first.report.plan_status == "" and list(tmp_path.glob("plan-*.json"))
    clock = ControlledClock(FAST)
    second = _opt(model, (x,), cache_dir=str(tmp_path), clock=clock)
    assert clock.calls == 0 and "decision cache" in second.report.plan_status
    assert second.report.kept_passes == first.report.kept_passes == ["fuse_attention"]
    other = _opt(model, (torch.randn(5, 16, 32),), cache_dir=str(tmp_path))
    assert other.report.plan_status == ""  # other shapes: measured, cached beside
    assert len(list(tmp_path.glob("plan-*.json"))) == 2


def test_plan_records_and_replays_the_fused_optimizer(tmp_path, attn):
    model, x = attn
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    costs = {**FAST, "fuse_optimizer": 0.3}
    fast, opt = _opt(model, (x,), optimizer=opt, loss_fn=lambda o: o.mean(), clock=ControlledClock(costs))
    assert fast.report.plan["optimizer"].startswith("torch.optim.AdamW(fused=True)")
    fast.report.save(tmp_path)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    again, opt2 = _opt(model, (x,), optimizer=opt2, loss_fn=lambda o: o.mean(),
                       plan=str(tmp_path / "plan.json"))
    assert opt2.param_groups[0]["fused"]
    assert [d.status for d in again.report.decisions] == ["replayed", "replayed"]


def test_capture_failure_runs_the_original_and_keeps_the_optimizer(monkeypatch, attn):
    from rewriter import pipeline
    from rewriter.errors import CaptureError
    model, x = attn

    def fail(*a, **k):
        raise CaptureError("no front-end captured it")
    monkeypatch.setattr(pipeline.Run, "_checked_capture", fail)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, opt2 = _opt(model, (x,), optimizer=opt, loss_fn=lambda o: o.mean())
    assert opt2 is opt and fast._runner() is model
    assert "capture failed" in fast.report.final["reason"]


def test_compile_of_an_fx_capture_compiles_the_rewritten_graph_in_both_modes():
    torch.manual_seed(0)
    model = HandAttention("mul").eval()
    x = torch.randn(2, 16, 32)
    fast = rewriter.optimize(model, (x,), passes=["fuse_attention"], progress=False, profile=False,
                             clock=ControlledClock({"fuse_attention": 0.5}), gate=QUICK)
    assert fast.report.front_end == "fx" and fast.report.kept_passes == ["fuse_attention"]
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.append(gm.code)
        return gm.forward
    fast.compile(backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    assert len(seen) == 1 and "scaled_dot_product_attention" in seen[0]
    fast.train()  # a retrace for training mode is compiled too
    torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    assert len(seen) == 2 and "scaled_dot_product_attention" in seen[1]


def test_compile_before_optimizing_is_refused():
    fast = rewriter.optimize(torch.nn.Linear(2, 2), progress=False)
    with pytest.raises(RuntimeError, match="example_inputs"):
        fast.compile()


def test_the_saved_report_has_each_profiled_step_with_its_tables_and_charts(tmp_path, attn, monkeypatch):
    import io
    import json

    from rewriter import profiling
    model, x = attn
    built = []
    real = profiling.result_from_torch
    monkeypatch.setattr(profiling, "result_from_torch", lambda *a: built.append(a[3]) or real(*a))
    fast = rewriter.optimize(model, (x,), gate=QUICK, progress=False, clock=ControlledClock(FAST),
                             knowledge_base=False)  # profile=True: the default
    assert built == []  # optimize() profiled both steps; their tables wait for a reader
    torch.save(fast, io.BytesIO())  # the whole model pickles, its report with its tables
    assert built == ["original", "optimized"]
    assert fast.report.top_ops_before and fast.report.top_ops_after
    fast.report.save(tmp_path)
    for label in ("original", "optimized"):
        table = tmp_path / "profile" / label / "operators.md"
        assert table.exists() and "aten::" in table.read_text()
        saved = json.loads((tmp_path / "profile" / label / "operators.json").read_text())
        assert saved["label"] == label and saved["rows"]
        assert "### Roofline" in table.read_text()  # the roofline as a table, always
        try:
            import matplotlib  # noqa: F401  (and as a chart where matplotlib imports)
        except ImportError:
            assert "the roofline chart would place" in table.read_text()  # the chart in words
            continue
        assert (tmp_path / "profile" / label / "roofline.png").exists()
    assert "_profiles" not in fast.report.to_dict()  # the tables are; the objects are not


def _on_another_machine(monkeypatch):
    from rewriter.devices.backends import CpuBackend
    monkeypatch.setattr(CpuBackend, "machine", lambda self: {"cpu_model": "Another CPU", "cpu_threads": "64"})


def test_a_plan_made_on_another_machine_is_measured_again_and_says_why(tmp_path, attn, monkeypatch):
    model, x = attn
    _opt(model, (x,)).report.save(tmp_path)
    _on_another_machine(monkeypatch)
    other = _opt(model, (x,), plan=str(tmp_path / "plan.json"))
    assert "not applied" in other.report.plan_status and "machine" in other.report.plan_status
    assert {d.pass_name: d.status for d in other.report.decisions}["fuse_attention"] == "kept"


def test_ranks_replay_rank_0s_plan_whatever_machine_they_are_on(tmp_path, attn, monkeypatch):
    # (optimize() under torch.distributed replays with strict_plan: a rank must run rank 0's graph)
    from rewriter.decide.replay import _plan_to_replay
    from rewriter.report import Report
    model, x = attn
    plan = _opt(model, (x,)).report.plan
    fingerprint = dict(plan["fingerprint"], machine={"cpu_model": "Another CPU", "cpu_threads": "64"})
    report = Report(model="m", device="cpu", mode="inference", dtype=None)
    assert _plan_to_replay(plan, fingerprint, report, strict=True) is plan
    assert _plan_to_replay(plan, fingerprint, report, strict=False) is None
    assert "machine" in report.plan_status


def test_the_knowledge_base_of_another_machine_is_not_replayed(tmp_path, attn, monkeypatch):
    model, x = attn
    kb = tmp_path / "kb.json"

    def source(fast):
        d = next(d for d in fast.report.decisions if d.pass_name == "fuse_attention")
        return d.regions[0]["source"]

    assert source(_opt(model, (x,), knowledge_base=kb)) == "measured"
    assert source(_opt(model, (x,), knowledge_base=kb)) == "knowledge base"
    _on_another_machine(monkeypatch)
    assert source(_opt(model, (x,), knowledge_base=kb)) == "measured"


def test_dynamo_skips_function_names_only_for_the_trace_logs_that_are_off(monkeypatch):
    # Dynamo names the function of every node it records for a debug header; the name costs a
    # tokenize of each traced source file. The capture skips it while those logs are off.
    import torch._dynamo.symbolic_convert as sc

    from rewriter.capture.front_ends import DynamoCapture, _unlogged_trace_headers_skipped
    real = sc.get_funcname
    with _unlogged_trace_headers_skipped():
        assert sc.get_funcname("x.py", 1) is None and sc.get_funcname is not real
    assert sc.get_funcname is real
    try:
        torch._logging.set_logs(trace_call=True)
        with _unlogged_trace_headers_skipped():
            assert sc.get_funcname is real  # a user reading the trace log gets the names
    finally:
        torch._logging.set_logs()
    # and a capture's calls are made with it: Dynamo asks for no name while it traces
    import rewriter.capture.front_ends as capture_module
    asked = []
    monkeypatch.setattr(capture_module, "_no_funcname", lambda f, l: asked.append(l))

    class OnlyHere(torch.nn.Module):  # code Dynamo has not traced in this process
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x)) * 3.0
    torch.manual_seed(0)
    model, x = OnlyHere(), torch.randn(2, 4)
    cap = DynamoCapture(model, "test")
    torch.testing.assert_close(cap(x), model(x))
    assert cap.slots and asked and sc.get_funcname is real
    # calls in flight at once (threads) leave the real one in place when the last ends
    with _unlogged_trace_headers_skipped():
        with _unlogged_trace_headers_skipped():
            pass
        assert sc.get_funcname is capture_module._no_funcname
    assert sc.get_funcname is real
