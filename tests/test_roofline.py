"""Roofline, attribution and shape outliers on controlled inputs (hand-computed FLOPs and bytes,
synthetic profiler events, fixed peaks), and on real CPU profiles for structure only."""
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from rewriter.profile import peaks as peaks_mod
from rewriter.profile.advisor import advise
from rewriter.profile.attribution import Origin, origin_from_frames
from rewriter.profile.op_analysis import analyze
from rewriter.profile.opcalls import OpCall, calls_from_ascend, calls_from_torch
from rewriter.profile.opcost import OpCost, op_cost
from rewriter.profile.peaks import Peaks, documented_peaks, resolve_peaks
from rewriter.profile.roofline import roofline_rows
from rewriter.profile.shape_outliers import find_outliers

PEAKS = Peaks("cpu: test", {"float32": 100.0}, 10.0, "given for the test")  # ridge 10 FLOP/B


# --- FLOPs and bytes, by hand ----------------------------------------------------------------

def test_gemm_flops_and_bytes():
    c = op_cost("aten::mm", ((256, 1000), (1000, 1000)), ("float", "float"))
    assert c.flops == 2 * 256 * 1000 * 1000 and c.kind == "gemm"
    assert c.bytes == 4 * (256 * 1000 + 1000 * 1000 + 256 * 1000)  # a, b read; out written
    # addmm: the bias add is one FLOP per output element, the bias read once
    c = op_cost("aten::addmm", ((1000,), (256, 1000), (1000, 1000), (), ()),
                ("float", "float", "float", "Scalar", "Scalar"))
    assert c.flops == 2 * 256 * 1000 * 1000 + 256 * 1000
    assert c.bytes == 4 * (1000 + 256 * 1000 + 1000 * 1000 + 256 * 1000)
    half = op_cost("aten::bmm", ((8, 64, 32), (8, 32, 16)), ("c10::BFloat16", "c10::BFloat16"))
    assert half.flops == 2 * 8 * 64 * 16 * 32 and half.bytes == 2 * (8 * 64 * 32 + 8 * 32 * 16 + 8 * 64 * 16)


def test_conv_flops_and_bytes_use_stride_and_padding():
    # mkldnn_convolution(input, weight, bias, padding, stride, dilation, groups)
    c = op_cost("aten::mkldnn_convolution", ((2, 3, 16, 16), (8, 3, 3, 3), (8,), (), (), (), ()),
                ("float", "float", "float", "ScalarList", "ScalarList", "ScalarList", "Scalar"),
                (None, None, None, [1, 1], [2, 2], [1, 1], 1))
    out = 2 * 8 * 8 * 8  # (16 + 2 - 3) // 2 + 1 = 8
    assert c.flops == 2 * out * 3 * 3 * 3 + out and c.kind == "conv"
    assert c.bytes == 4 * (2 * 3 * 16 * 16 + 8 * 27 + 8 + out)


def test_attention_flops_and_bytes():
    q = (2, 4, 16, 8)  # (B, heads, T, head_dim)
    c = op_cost("aten::_scaled_dot_product_flash_attention_for_cpu", (q, q, q, (), (), (), ()),
                ("float", "float", "float", "Scalar", "Scalar", "", ""))
    assert c.flops == 2 * (2 * 2 * 4 * 16 * 16 * 8)  # QK^T and PV, 2 FLOPs per multiply-add
    assert c.bytes == 4 * 4 * (2 * 4 * 16 * 8) and c.kind == "attention"


def test_elementwise_and_reduction_by_element_count():
    c = op_cost("aten::add", ((8, 64), (64,), ()), ("float", "float", "Scalar"))
    assert c == OpCost(8 * 64, 4 * (8 * 64 + 64 + 8 * 64), "elementwise")  # broadcast output
    s = op_cost("aten::_softmax", ((4, 128),), ("float",))
    assert (s.flops, s.bytes, s.kind) == (4 * 128, 4 * 2 * 4 * 128, "reduction")
    assert op_cost("aten::view", ((4, 128), ()), ("float", "ScalarList")) is None  # no rule
    assert op_cost("MatMulV2", ((256, 1000), (256, 1000)), ("FLOAT16", "FLOAT16")).flops == \
        2 * 256 * 256 * 1000  # an NPU kernel: K is the dimension both share (transposed b)


# --- attribution ------------------------------------------------------------------------------

MODEL_SOURCE = '''import torch


class Block(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        return torch.matmul(y, self.w1.t())
'''


def _event(name, parent=None, seq=-1, thread=1, fwd_thread=0, shapes=(), dtypes=(), us=1.0):
    e = SimpleNamespace(name=name, cpu_parent=parent, cpu_children=[], sequence_nr=seq, thread=thread,
                        fwd_thread=fwd_thread, input_shapes=[list(s) for s in shapes], input_dtypes=list(dtypes),
                        concrete_inputs=[], self_cpu_time_total=us)
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_backward_gemm_maps_to_the_forward_line_that_created_it(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL_SOURCE)
    module = _event("nn.Module: Block_0")
    frame = _event(f"{path}(5): forward", module)
    call = _event("<built-in method matmul of type object at 0x1>", frame)
    fwd = _event("aten::matmul", call, seq=7, thread=1)
    fwd_mm = _event("aten::mm", fwd, seq=7, shapes=[(4, 8), (8, 16)], dtypes=["float", "float"], us=10)
    engine = _event("autograd::engine::evaluate_function: MmBackward0", _event("backward"), seq=7,
                    thread=2, fwd_thread=1)
    bwd = _event("aten::mm", _event("MmBackward0", engine), thread=2, shapes=[(16, 4), (4, 8)],
                 dtypes=["float", "float"], us=20)
    calls = {id(e): c for e, c in zip([fwd, fwd_mm, bwd], calls_from_torch([fwd, fwd_mm, bwd, engine]))}
    forward, backward = calls[id(fwd_mm)].origin, calls[id(bwd)].origin
    assert (forward.function, forward.line, forward.code) == ("Block.forward", 7,
                                                               "return torch.matmul(y, self.w1.t())")
    assert forward.module == "Block_0" and not forward.backward
    assert backward.backward and backward.grad_fn == "MmBackward0"
    assert backward.forward() == forward
    assert calls[id(fwd)].cost is None and calls[id(fwd_mm)].cost.flops == 2 * 4 * 8 * 16  # counted once
    row = roofline_rows(list(calls.values()), PEAKS)[0]
    assert row.name == "aten::mm" and row.origins[0][1:3] == (True, True)  # one line, both passes


def test_an_operator_spelled_as_python_syntax_is_found_by_its_symbol(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL_SOURCE)
    origin = origin_from_frames([f"{path}(5): forward"], "mul")
    assert origin.line == 6 and origin.code == "y = x * 2"
    assert origin_from_frames(["torch/nn/functional.py(10): linear"]) is None  # no user frame


def test_the_optimizer_s_operators_name_its_step_not_the_script_that_called_it(tmp_path):
    # torch.optim's frames are library code; the next user frame out is the training loop or a
    # console script's <module> line, which did not run these operators: the step does.
    script = tmp_path / "rewriter"
    script.write_text("import sys\n" * 7 + "sys.exit(main())\n")
    frames = ("aten::add_", "torch/optim/adamw.py(350): _single_tensor_adamw",
              "torch/optim/adamw.py(200): step", "Optimizer.step#AdamW.step", f"{script}(8): <module>")
    assert origin_from_frames(frames).function == "Optimizer.step#AdamW.step"
    assert origin_from_frames(frames[:-1]).function == "Optimizer.step#AdamW.step"
    # an operator the script's own line ran is still that line's
    assert origin_from_frames(("aten::add_", f"{script}(8): <module>")).file == str(script)


class Block(nn.Module):
    def __init__(self, hidden=24):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, hidden))

    def forward(self, x):
        return torch.relu(torch.matmul(x, self.w1.t()))


def test_a_real_profile_attributes_forward_and_backward_to_the_model_line():
    model, x = Block(), torch.randn(8, 24)
    with torch.profiler.profile(record_shapes=True, with_stack=True) as prof:
        model(x).sum().backward()
    calls = [c for c in calls_from_torch(prof.events()) if c.name == "aten::mm"]
    assert {c.origin.backward for c in calls} == {False, True}
    for c in calls:
        assert c.origin.code == "return torch.relu(torch.matmul(x, self.w1.t()))"
        assert c.origin.function == "Block.forward" and c.origin.file.endswith("test_roofline.py")


# --- roofline ---------------------------------------------------------------------------------

def _calls(name, sig, n, us_each, flops, nbytes, kind="gemm", origin=None):
    return [OpCall(name, us_each, sig, ("float",), OpCost(flops, nbytes, kind), origin) for _ in range(n)]


def test_roofline_says_compute_or_memory_bound_and_how_far_from_its_roof():
    # gemm: 1e9 FLOPs, 1e7 bytes (100 FLOP/B, above the ridge of 10) in 20 ms -> 50 GFLOP/s of 100
    # add: 1e6 FLOPs, 1.2e7 bytes (0.083 FLOP/B) in 4 ms -> 3 GB/s of 10
    calls = _calls("aten::mm", ((1, 1),), 2, 10_000, 5e8, 5e6) + \
        _calls("aten::add", ((1,),), 1, 4_000, 1e6, 1.2e7, "elementwise")
    mm, add = roofline_rows(calls, PEAKS, steps=1)
    assert (mm.name, mm.bound, mm.calls) == ("aten::mm", "compute", 2)
    assert mm.gflops_per_s == pytest.approx(50.0) and mm.roof_fraction == pytest.approx(0.5)
    assert add.bound == "memory" and add.gb_per_s == pytest.approx(3.0)
    assert add.roof_fraction == pytest.approx(0.3)  # of the bandwidth roof at its intensity
    assert "compute-bound, 50% of peak compute" in mm.verdict()
    assert "memory-bound, 30% of peak bandwidth" in add.verdict()
    assert mm.share == pytest.approx(20 / 24)
    none = roofline_rows(calls, None)[0]
    assert none.bound == "" and "no peaks" in none.verdict()


# --- shape outliers ---------------------------------------------------------------------------

def test_an_outlier_shape_is_flagged_and_a_uniform_set_is_not():
    # 1 GFLOP per call; the odd shape takes 15x the time of the others (case study: 0.8 vs 12.4 ms)
    uniform = (_calls("aten::mm", ((256, 1024), (1024, 256)), 2, 800, 1e9, 1e7)
               + _calls("aten::mm", ((512, 1024), (1024, 128)), 2, 820, 1e9, 1e7)
               + _calls("aten::mm", ((128, 1024), (1024, 512)), 2, 790, 1e9, 1e7))
    assert find_outliers(roofline_rows(uniform, PEAKS, by_shape=True)) == []
    odd = uniform + _calls("aten::mm", ((256, 1000), (1000, 256)), 2, 12_400, 1e9, 1e7)
    (o,) = find_outliers(roofline_rows(odd, PEAKS, by_shape=True))
    assert o.row.signature == ((256, 1000), (1000, 256)) and o.ratio == pytest.approx(12_400 / 800)
    # a small shape is slower per FLOP by nature: not an outlier
    small = uniform + _calls("aten::mm", ((8, 8), (8, 8)), 2, 100, 1e3, 1e3)
    assert find_outliers(roofline_rows(small, PEAKS, by_shape=True)) == []


def test_the_advisor_links_an_outlier_to_its_passes_and_line():
    origin = Origin("Block.forward", "model.py", 30, "x = torch.matmul(x, self.weight.t())")
    calls = (_calls("aten::mm", ((256, 1024), (1024, 256)), 2, 800, 1e9, 1e7)
             + _calls("aten::mm", ((512, 1024), (1024, 128)), 2, 820, 1e9, 1e7)
             + _calls("aten::mm", ((256, 1000), (1000, 256)), 2, 12_400, 1e9, 1e7, origin=origin))
    from rewriter.profiling import OpRow, ProfileResult
    result = ProfileResult("p", "npu", 1, [OpRow("aten::mm", 6, 28.0, 28.0, 1.0)])
    result.analysis = analyze(calls, PEAKS)
    f = {f.rule: f for f in advise(result)}["shape_outliers"]
    assert {"pad_to_alignment", "make_contiguous", "fuse_linear"} <= set(f.passes)
    assert "cast_to_half" in f.passes  # fp32 on a device with a half-precision unit
    assert "1000 not multiples of 16" in f.detail and "model.py:30" in f.detail
    assert f.sources == ("Block.forward model.py:30",)


# --- peaks ------------------------------------------------------------------------------------

def test_peaks_are_measured_once_and_cached_with_the_cpu_model(tmp_path, monkeypatch):
    measured = []

    def fake_measure(backend, **kw):
        measured.append(backend.name)
        return Peaks("cpu: x", {"float32": 50.0}, 5.0, "measured (fake)", True, peaks_mod._machine(backend))

    monkeypatch.setattr(peaks_mod, "measure_peaks", fake_measure)
    first = peaks_mod.device_peaks("cpu", cache_dir=tmp_path)
    second = peaks_mod.device_peaks("cpu", cache_dir=tmp_path)
    assert measured == ["cpu"] and second.gflops == first.gflops == {"float32": 50.0}
    assert "read from the cache" in second.source
    entry = json.loads((tmp_path / "peaks.json").read_text())["entries"][0]
    assert entry["machine"]["cpu_model"] == peaks_mod.cpu_model() and entry["machine"]["torch"]
    (tmp_path / "peaks.json").write_text("{not json")
    assert peaks_mod.device_peaks("cpu", cache_dir=tmp_path).gflops == {"float32": 50.0}  # measured again
    assert measured == ["cpu", "cpu"]


def test_documented_and_given_peaks_say_where_they_come_from(tmp_path):
    h100 = documented_peaks("h100-sxm")
    assert h100.source.startswith("documented") and h100.gflops_for("c10::BFloat16") == 989_000.0
    path = tmp_path / "npu.json"
    path.write_text(json.dumps({"device": "npu: mine", "gflops": {"float16": 300000}, "gb_per_s": 1600,
                                "source": "my datasheet"}))
    assert resolve_peaks(str(path)).gb_per_s == 1600.0
    with pytest.raises(ValueError, match="no documented peaks"):
        resolve_peaks("TPU-v9")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_peaks(str(tmp_path / "missing.json"))


def test_measured_peaks_are_positive_and_name_the_machine():
    p = peaks_mod.measure_peaks("cpu", gemm_size=128, copy_mib=1, repeats=1)
    assert p.measured and p.gflops["float32"] > 0 and p.gb_per_s > 0
    assert p.machine["cpu_model"] == peaks_mod.cpu_model() and "measured" in p.source


# --- NPU profiles -----------------------------------------------------------------------------

def test_npu_kernel_details_give_the_roofline_and_operator_stacks_the_lines(tmp_path):
    out = tmp_path / "ASCEND_PROFILER_OUTPUT"
    out.mkdir()
    model = tmp_path / "model.py"
    model.write_text(MODEL_SOURCE)
    (out / "operator_details.csv").write_text(
        "Name,Input Shapes,Call Stack,Host Self Duration(us),Host Total Duration(us),"
        "Device Self Duration(us),Device Total Duration(us)\n"
        f'aten::mm,"256,1000;1000,256","{model}(7): forward;\r\ntorch/nn/modules/module.py(1): _call_impl",'
        "5,5,0,800\n")
    (out / "kernel_details.csv").write_text(
        "Device_id,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),Block Num,"
        "Input Shapes,Input Data Types,Input Formats,Output Shapes,Output Data Types,Output Formats\n"
        '0,MatMulV2_1,MatMulV2,AI_CORE,1,800,0,20,"256,1024;1024,256",FLOAT16;FLOAT16,ND;ND,"256,256",FLOAT16,ND\n'
        '0,MatMulV2_2,MatMulV2,AI_CORE,2,12400,0,20,"256,1000;1000,256",FLOAT16;FLOAT16,ND;ND,"256,256",FLOAT16,ND\n'
        '0,MatMulV2_3,MatMulV2,AI_CORE,3,820,0,20,"256,1024;1024,256",FLOAT16;FLOAT16,ND;ND,"256,256",FLOAT16,ND\n')
    calls = calls_from_ascend(str(out))
    assert [c.cost.flops for c in calls] == [2 * 256 * 256 * 1024, 2 * 256 * 256 * 1000, 2 * 256 * 256 * 1024]
    assert calls[0].cost.bytes == 2 * (2 * 256 * 1024 + 256 * 256)
    assert calls[1].origin.line == 7 and "matmul" in calls[1].origin.code
    a = analyze(calls, Peaks("npu: test", {"float16": 1000.0}, 100.0, "given"))
    assert a.rows[0].bound == "compute" and a.rows[0].dtype == "FLOAT16"
    (o,) = a.outliers
    assert o.row.signature == ((256, 1000), (1000, 256))


def test_roofline_chart_is_a_png_or_the_table_says_what_it_would_show(tmp_path, monkeypatch):
    calls = _calls("aten::mm", ((1, 1),), 2, 10_000, 5e8, 5e6) + \
        _calls("aten::add", ((1,),), 1, 4_000, 1e6, 1.2e7, "elementwise")
    a = analyze(calls, PEAKS)
    try:
        import matplotlib  # noqa: F401

        from rewriter.profile.roofline import plot_roofline
        with open(plot_roofline(a.rows, PEAKS, tmp_path / "r.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    except ImportError:
        pass
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    from rewriter.profiling import OpRow, ProfileResult
    result = ProfileResult("p", "cpu", 1, [OpRow("aten::mm", 2, 20.0, 20.0, 0.8), OpRow("aten::add", 1, 4.0, 4.0, 0.2)])
    result.analysis = a
    paths = result.save(tmp_path / "out")
    assert "roofline" not in paths
    md = open(paths["table"]).read()
    assert "the roofline chart would place 2 operators" in md and "ridge point 10.0 FLOP/B" in md
