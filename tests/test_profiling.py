"""Profiling: tables and comparison on controlled profiles, real CPU profiles checked for
structure (never for timings), the NPU path on the reference shim, GPT-2 eager vs optimized."""
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import rewriter
from rewriter import profiling
from rewriter.profile.advisor import advise
from rewriter.profiling import (
    OpRow,
    ProfileResult,
    ProfileSettings,
    compare,
    rows_from_key_averages,
)
from tests.controlled import QUICK, ControlledClock


def _avg(key, count, self_us, total_us, shapes=None, **device):
    return SimpleNamespace(key=key, count=count, self_cpu_time_total=self_us, cpu_time_total=total_us,
                           input_shapes=shapes, **device)


def _result(rows, label="r", **kw):
    """A ProfileResult from (name, calls, self_ms) triples; shares computed as profiling does."""
    total = sum(ms for _, _, ms in rows)
    ops = [OpRow(n, c, ms, ms, ms / total) for n, c, ms in sorted(rows, key=lambda r: -r[2])]
    return ProfileResult(label, "cpu", 1, ops, **kw)


# --- the table -------------------------------------------------------------------------------

def test_table_is_per_step_sorted_and_shares_sum_to_one():
    averages = [_avg("aten::add", 8, 400.0, 400.0), _avg("aten::mm", 4, 1200.0, 1500.0),
                _avg("aten::view", 20, 400.0, 400.0)]
    rows, _ = rows_from_key_averages(averages, steps=2)
    assert [r.name for r in rows][0] == "aten::mm"
    mm = rows[0]
    assert (mm.calls, mm.self_ms, mm.total_ms) == (2, 0.6, 0.75)  # halved: two profiled steps
    assert mm.share == pytest.approx(0.6)
    assert sum(r.share for r in rows) == pytest.approx(1.0)


def test_table_keeps_the_most_expensive_input_shapes_first():
    averages = [_avg("aten::mm", 3, 300.0, 300.0)]
    by_shape = [_avg("aten::mm", 1, 50.0, 50.0, [[8, 64], [64, 16]]),
                _avg("aten::mm", 2, 250.0, 250.0, [[8, 64], [64, 100]])]
    rows, shape_rows = rows_from_key_averages(averages, 1, by_shape)
    assert rows[0].input_shapes == (((8, 64), (64, 100)), ((8, 64), (64, 16)))
    assert [r.input_shapes for r in shape_rows] == [(((8, 64), (64, 100)),), (((8, 64), (64, 16)),)]
    assert profiling.format_shapes(rows[0].input_shapes) == "8x64, 64x100 | 8x64, 64x16"


def test_device_time_is_the_table_time_when_the_profile_has_a_device():
    averages = [_avg("aten::mm", 1, 50.0, 60.0, self_device_time_total=900.0, device_time_total=900.0),
                _avg("aten::empty", 1, 40.0, 40.0, self_device_time_total=0.0, device_time_total=0.0)]
    rows, _ = rows_from_key_averages(averages)
    assert rows[0].self_ms == pytest.approx(0.9) and rows[0].share == pytest.approx(1.0)


def test_bad_step_count_is_refused():
    with pytest.raises(ValueError, match="steps"):
        rows_from_key_averages([], steps=0)
    with pytest.raises(ValueError, match="active"):
        ProfileSettings(active=0)
    with pytest.raises(ValueError, match="npu_level"):
        ProfileSettings(npu_level="Level9")


def test_top_level_sequence_skips_nested_operators_and_annotations():
    events = [("ProfilerStep#1", 0, 100, 1), ("aten::matmul", 1, 10, 1), ("aten::bmm", 2, 9, 1),
              ("aten::softmax", 11, 15, 1), ("aten::_softmax", 12, 14, 1),
              ("autograd::engine::evaluate_function: X", 20, 30, 2), ("aten::mm", 21, 29, 2),
              ("npu::npu_fusion_attention", 16, 19, 1)]
    assert profiling.top_level_ops(events) == ("matmul", "softmax", "npu_fusion_attention", "mm")


def test_markdown_calls_out_the_top_three_operators():
    r = _result([("aten::mm", 4, 6.0), ("aten::add", 10, 2.0), ("aten::gelu", 2, 1.0),
                 ("aten::view", 30, 1.0)])
    md = r.to_markdown(top_k=2, advice=False)
    assert "Top three:\n1. `aten::mm` 60.0%" in md and "\n3. `aten::gelu`" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and "operator" not in line]
    assert len(table) == 2  # top_k rows


# --- the comparison --------------------------------------------------------------------------

def _before_after():
    before = _result([("aten::softmax", 2, 1.0), ("aten::bmm", 4, 2.0), ("aten::addmm", 8, 4.0),
                      ("aten::add", 10, 1.0), ("aten::view", 20, 0.5)], "eager")
    after = _result([("aten::_scaled_dot_product_flash_attention_for_cpu", 2, 1.5),
                     ("aten::addmm", 8, 3.0), ("aten::add", 10, 1.5), ("aten::view", 20, 0.52)], "optimized")
    return before, after


def test_comparison_names_what_vanished_appeared_and_changed():
    cmp = compare(*_before_after())
    assert [c.name for c in cmp.vanished] == ["aten::bmm", "aten::softmax"]
    assert [c.name for c in cmp.appeared] == ["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert [c.name for c in cmp.faster] == ["aten::addmm"]
    assert [c.name for c in cmp.slower] == ["aten::add"]
    view = next(c for c in cmp.changes if c.name == "aten::view")
    assert view.status == "unchanged"  # +4%: under min_change
    assert cmp.changes[0].name == "aten::bmm"  # largest change first
    assert (cmp.before_step_ms, cmp.after_step_ms) == (pytest.approx(8.5), pytest.approx(6.52))
    assert cmp.labels == ("eager", "optimized")
    md = cmp.to_markdown()
    assert "Vanished: `aten::bmm`" in md and "-> 6.52 ms" in md


def test_comparison_thresholds_are_the_callers():
    cmp = compare(*_before_after(), min_change=0.5)
    assert not cmp.faster and not cmp.slower  # addmm -25%, add +50%: neither more than 50%
    with pytest.raises(ValueError, match="min_change"):
        compare(*_before_after(), min_change=-1)


def test_comparison_of_top_k_lists_knows_the_step_and_says_it_was_cut():
    before, after = _before_after()
    cmp = compare(before.top(2), after.top(2))
    assert cmp.before_step_ms == pytest.approx(8.5)  # from the rows' shares
    assert any("cut to its top" in n for n in cmp.notes)
    with pytest.raises(ValueError, match="OpRow"):
        compare([{"name": "x"}], after)


def test_comparison_saves_markdown_and_json(tmp_path):
    paths = compare(*_before_after()).save(tmp_path)
    data = json.loads(open(paths["json"]).read())
    assert {c["name"]: c["status"] for c in data["changes"]}["aten::softmax"] == "vanished"
    assert "## Operators before/after: eager -> optimized" in open(paths["table"]).read()


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    before, after = _before_after()
    path = profiling.plot_top_ops(before, after, tmp_path / "c.png", labels=("eager", "optimized"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_chart_is_skipped_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    before, _ = _before_after()
    assert profiling.plot_top_ops(before, path=tmp_path / "c.png") is None
    paths = before.save(tmp_path)
    assert "chart" not in paths and os.path.exists(paths["table"])
    assert any("matplotlib is not installed" in n for n in before.notes)


# --- real CPU profiles (structure only) ------------------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_profile_model_writes_trace_tensorboard_table_and_restores_the_model(tmp_path):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters())
    weights = [p.detach().clone() for p in model.parameters()]
    r = profiling.profile_model(model, (torch.randn(8, 16),), training=True, optimizer=opt,
                                loss_fn=lambda out: out.sum(), out_dir=tmp_path, label="net")
    assert r.steps == 2 and r.device == "cpu" and r.row("aten::addmm").calls == 2
    assert r.row("Optimizer.step#AdamW.step") is not None and r.wall_ms is not None
    assert r.peak_memory_mb is not None and r.peak_memory_mb > 0
    assert "linear" in r.sequence and "relu" in r.sequence
    trace = json.load(open(r.files["trace"]))  # valid Chrome trace JSON
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
    assert r.files["trace"] == str(tmp_path / "trace.json")
    assert any(f.endswith(".pt.trace.json") for f in os.listdir(r.files["tensorboard"]))
    assert "| aten::addmm |" in open(r.files["table"]).read()
    for p, w in zip(model.parameters(), weights):  # profiling ran optimizer steps, then restored
        assert torch.equal(p, w)
    assert not opt.state


def test_profile_counts_the_host_page_faults_of_the_least_faulting_step():
    pytest.importorskip("resource")  # POSIX: the kernel counts them
    import mmap
    pages = 300  # not a multiple of 2 MiB: a transparent huge page would fault once for 512

    def fresh_pages():  # memory mapped afresh and touched, as a trimmed heap is every step
        m = mmap.mmap(-1, pages * mmap.PAGESIZE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            m.madvise(mmap.MADV_NOHUGEPAGE)
        for i in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
            m[i] = 1
        m.close()

    buffer = bytearray(pages * mmap.PAGESIZE)

    def same_pages():  # the same memory every step: faulted once, before profiling
        for i in range(0, len(buffer), mmap.PAGESIZE):
            buffer[i] = 1

    same_pages()
    settings = profiling.ProfileSettings(record_shapes=False)
    touched = profiling.profile_run(fresh_pages, "cpu", settings=settings, peaks=None)
    quiet = profiling.profile_run(same_pages, "cpu", settings=settings, peaks=None)
    assert touched.page_faults >= pages > quiet.page_faults
    assert f"{touched.page_faults} host page faults a step" in touched.to_markdown()
    assert touched.to_dict()["page_faults"] == touched.page_faults


def test_profile_step_keeps_its_signature():
    model, x = _Net(), torch.randn(4, 16)
    rows = profiling.profile_step(lambda: model(x), [torch.profiler.ProfilerActivity.CPU], top_k=3)
    assert len(rows) == 3 and all(isinstance(r, OpRow) for r in rows)
    assert rows[0].self_ms >= rows[1].self_ms >= rows[2].self_ms


def test_profile_model_refuses_bad_input():
    with pytest.raises(ValueError, match="steps"):
        profiling.profile_model(_Net(), (torch.randn(2, 16),), training=False, steps=0)
    with pytest.raises(TypeError, match="example_inputs"):
        profiling.profile_model(_Net(), "x", training=False)


def test_periodic_profiler_records_one_window_per_period(tmp_path):
    model, x = _Net(), torch.randn(4, 16)
    seen = []
    with profiling.PeriodicProfiler(every=3, active=1, warmup=1, out_dir=tmp_path,
                                    on_result=seen.append) as pp:
        for _ in range(8):  # ends inside a third window (warm-up done, step 9 unrun): dropped
            model(x)
            pp.step()
    assert [r.label for r in pp.results] == ["steps 3-3", "steps 6-6"]
    assert seen == list(pp.results) and pp.results[0].row("aten::addmm").calls == 2
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step_")) == ["step_3", "step_6"]
    with pytest.raises(ValueError, match="every"):
        profiling.PeriodicProfiler(every=2, active=2, warmup=1)


# --- NPU path on the reference shim ----------------------------------------------------------

class _Int64Net(nn.Module):
    """A float path and an int64 comparison (AI CPU on the shim, as TensorEqual int64 is)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, ids):
        return self.fc(x) * (ids == 3).unsqueeze(-1).float()


def test_npu_path_uses_torch_npu_profiler_and_reads_its_output(tmp_path, fake_torch_npu, monkeypatch):
    made = []
    real_profile = fake_torch_npu.profiler.profile
    monkeypatch.setattr(fake_torch_npu.profiler, "profile",
                        lambda **kw: made.append(kw) or real_profile(**kw))
    r = profiling.profile_model(_Int64Net(), (torch.randn(8, 16), torch.randint(0, 5, (8,))),
                                training=False, device="npu", out_dir=tmp_path, label="npu")
    (kw,) = made
    p = fake_torch_npu.profiler
    assert kw["activities"] == [p.ProfilerActivity.CPU, p.ProfilerActivity.NPU]
    assert kw["experimental_config"].profiler_level == p.ProfilerLevel.Level1
    assert kw["experimental_config"].export_type == p.ExportType.Text
    ascend = r.files["ascend_pt"]
    assert ascend.endswith("_ascend_pt") and os.path.dirname(ascend) == str(tmp_path / "tensorboard" / "npu")
    assert r.device == "npu" and r.row("aten::eq").calls == 1 and r.row("aten::addmm") is not None
    eq = next(k for k in r.kernels if k.type == "eq")
    assert eq.accelerator_core == "AI_CPU" and eq.input_dtypes == ("INT64",)
    assert "eq" in r.sequence and "linear" in r.sequence  # from trace_view.json's string ts
    assert isinstance(json.load(open(r.files["trace"])), list)  # trace_view.json, copied
    assert r.peak_memory_mb is not None
    findings = advise(r, settings=rewriter.profile.advisor.AdvisorSettings(aicpu_min_us=0))
    ai_cpu = next(f for f in findings if f.rule == "ai_cpu")
    assert ai_cpu.passes == ("narrow_int64",) and "eq" in ai_cpu.operators


def test_npu_path_without_torch_npu_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match="torch_npu"):
        profiling.open_profiler("npu")


def test_npu_trace_timestamps_are_read_without_float_rounding():
    # Epoch microseconds as strings (§3.3): 1 ns apart, beyond a float's precision at 1.7e15.
    events = [{"ph": "X", "name": "aten::b", "ts": "1700000000000000.002", "dur": 0.0005, "tid": 1},
              {"ph": "X", "name": "aten::a", "ts": "1700000000000000.001", "dur": 0.0005, "tid": 1}]
    from rewriter.profile import ascend_tables
    assert profiling.top_level_ops(ascend_tables._timed_events(events)) == ("a", "b")
    assert ascend_tables._npu_signature('"8,64;64,48;"') == ((8, 64), (64, 48), ())


def test_periodic_profiler_on_npu(fake_torch_npu):
    model, x, ids = _Int64Net(), torch.randn(4, 16), torch.randint(0, 5, (4,))
    with profiling.PeriodicProfiler(every=3, active=1, warmup=1, device="npu") as pp:
        for _ in range(6):
            model(x, ids)
            pp.step()
    assert len(pp.results) == 2 and all(r.row("aten::eq") for r in pp.results)


# --- GPT-2, eager vs optimized ---------------------------------------------------------------

def test_gpt2_training_step_eager_vs_optimized(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Attention dropout 0: with dropout, CPU SDPA runs its math kernel (softmax inside).
    # One layer: Dynamo's compile time, not profiling, is this test's cost.
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=16,
                                  attn_pdrop=0.0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 128, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW(model.parameters())
    before = profiling.profile_model(model, inputs, training=True, optimizer=opt, out_dir=tmp_path / "eager")
    # The controlled clock makes the gate keep fuse_attention: this test is about profiling.
    # (A train()-mode model is optimized for training; no optimizer keeps fuse_optimizer out.)
    fast = rewriter.optimize(model, inputs, passes=["fuse_attention"], gate=QUICK, progress=False,
                             clock=ControlledClock({"fuse_attention": 0.5}), profile=False)
    assert fast.report.mode == "training" and fast.report.kept_passes == ["fuse_attention"]
    after = profiling.profile_model(fast, inputs, training=True, optimizer=opt, out_dir=tmp_path / "opt")
    rules_before = {f.rule for f in advise(before)}
    rules_after = {f.rule for f in advise(after)}
    assert "unfused_attention" in rules_before and "unfused_attention" not in rules_after
    assert "unfused_gelu" in rules_before and "unfused_gelu" in rules_after  # not this pass's work
    cmp = compare(before, after)
    assert {"aten::softmax", "aten::_softmax", "aten::bmm"} <= {c.name for c in cmp.vanished}
    assert any("scaled_dot_product" in c.name for c in cmp.appeared)
    for r in (before, after):
        assert "traceEvents" in json.load(open(r.files["trace"]))
        assert os.listdir(r.files["tensorboard"])
    assert "Unfused attention" in open(before.files["table"]).read()


# --- roofline, model lines and kineto's noise ---------------------------------------------------

def test_kineto_start_stop_lines_are_kept_off_stderr_and_other_lines_pass(capfd):
    with profiling.kineto_quiet():
        os.write(2, b"USDT:2026-12-01 09:09:33 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a line of the user's\n")
    profiling.profile_run(lambda: torch.ones(4) + 1, "cpu", peaks=None,
                          settings=ProfileSettings(wait=0, warmup=1, active=1))
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert "a line of the user's" in err


def test_profile_rows_name_their_model_line_and_roofline(tmp_path):
    from tests.test_roofline import PEAKS, Block
    torch.manual_seed(0)
    model = Block()
    r = profiling.profile_model(model, (torch.randn(8, 24),), training=True, loss_fn=lambda o: o.sum(),
                                peaks=PEAKS, out_dir=tmp_path, settings=ProfileSettings(wait=0, warmup=1))
    mm = r.row("aten::mm")
    assert "`Block.forward`" in mm.origin and "and its backward" in mm.origin
    assert mm.roofline.startswith(("compute-bound", "memory-bound"))
    assert not any(profiling.is_python_frame(row.name) for row in r.rows)  # with_stack frames folded
    assert r.analysis.row("aten::mm").flops == 2 * 2 * 8 * 24 * 24  # forward, grad weight (x needs none)
    md = open(r.files["table"]).read()
    assert "### Roofline" in md and "given for the test" in md and "### Per shape" in md
    data = json.load(open(r.files["json"]))
    assert data["analysis"]["rows"][0]["origins"]


def test_npu_profile_gets_the_same_analysis(tmp_path, fake_torch_npu):
    from tests.test_roofline import PEAKS
    r = profiling.profile_model(_Int64Net(), (torch.randn(8, 16), torch.randint(0, 5, (8,))),
                                training=False, device="npu", out_dir=tmp_path, label="npu", peaks=PEAKS)
    mul = r.analysis.row("mul")  # a kernel type from kernel_details.csv: (8, 4) * (8, 1), FLOAT
    assert (mul.flops, mul.bytes, mul.bound, mul.dtype) == (32, 4 * (32 + 8 + 32), "memory", "FLOAT")
    assert "kernel_details.csv" in " ".join(r.analysis.notes)


def test_optimize_report_names_the_top_operators_model_line_and_roofline():
    from rewriter.report import Report
    rows = [OpRow("aten::mm", 2, 6.0, 6.0, 0.6, origin="`Block.forward` model.py:7 `y = x @ w`, and its backward",
                  roofline="compute-bound, 35% of peak compute (35.0 of 100 GFLOP/s)"),
            OpRow("ProfilerStep*", 1, 1.0, 10.0, 0.1)]
    md = Report("Block", "cpu", "training", None, top_ops_before=rows).to_markdown()
    assert ("1. `aten::mm` 60.0% (6.00 ms, 2 calls) — `Block.forward` model.py:7 `y = x @ w`, and its "
            "backward; compute-bound, 35% of peak compute") in md


def test_a_recorded_profile_builds_its_tables_once_and_only_when_asked(monkeypatch):
    model, x = _Net(), torch.randn(4, 16)
    built = []
    real = profiling.result_from_torch
    monkeypatch.setattr(profiling, "result_from_torch", lambda *a: built.append(1) or real(*a))
    recorded = profiling.record_run(lambda: model(x), "cpu", label="net", peaks=None)
    assert not built and not recorded.built  # the steps ran; no table yet
    result = recorded.result()
    assert built == [1] and recorded.built and result.label == "net"
    assert any(r.name == "aten::addmm" for r in result.rows)  # _Net's Linear
    assert recorded.result() is result and built == [1]  # kept, not built again
    assert result.page_faults == recorded.page_faults
    import pickle
    pending = profiling.record_run(lambda: model(x), "cpu", label="net", peaks=None)
    copied = pickle.loads(pickle.dumps(pending))  # with its tables, not the profiler's events
    assert copied.built and copied.result().label == "net" and len(built) == 2


def test_a_report_builds_its_tables_from_recorded_profiles_on_first_read():
    from rewriter.report import Report
    model, x = _Net(), torch.randn(4, 16)
    before = profiling.record_run(lambda: model(x), "cpu", label="original", peaks=None)
    after = profiling.record_run(lambda: model(x), "cpu", label="optimized", peaks=None)
    report = Report("Net", "cpu", "inference", None)
    report.profiles_later(before, after)
    assert not before.built and not after.built
    assert report.top_ops_before and report.top_ops_after  # the first read builds both
    assert before.built and after.built and report.op_comparison is not None
    saved = report.to_dict()
    assert saved["top_ops_before"] and saved["op_comparison"] is not None


def test_a_table_that_cannot_be_built_is_a_note_in_the_report():
    from rewriter.report import Report

    def broken():
        raise RuntimeError("kineto gave no events")
    report = Report("Net", "cpu", "inference", None)
    report.profiles_later(profiling.RecordedProfile(broken, None))
    assert report.top_ops_before == []
    assert "profiling failed: RuntimeError: kineto gave no events" in report.to_markdown()


def test_a_report_with_tables_pending_pickles_with_its_tables():
    import io
    import pickle

    from rewriter.report import Report
    model, x = _Net(), torch.randn(4, 16)
    report = Report("Net", "cpu", "inference", None)
    report.profiles_later(profiling.record_run(lambda: model(x), "cpu", label="original", peaks=None))
    loaded = pickle.loads(pickle.dumps(report))
    assert loaded.top_ops_before and loaded.top_ops_before == report.top_ops_before
    torch.save(report, io.BytesIO())  # as torch.save(model) of an optimized model does
    assert "_pending_profiles" not in loaded.__dict__
