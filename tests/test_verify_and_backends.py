
import pytest
import torch

import rewriter
from rewriter.decide.verify import (
    Yardstick,
    compare_runs,
    dropout_disabled,
    flatten_output,
    tolerance_for,
)
from rewriter.devices.backends import CpuBackend, NpuBackend, get_backend
from tests.controlled import QUICK, ControlledClock
from tests.models import HandAttention

FP32 = tolerance_for(torch.float32)


def test_rounding_difference_passes_and_real_difference_fails():
    want = {"output y": torch.linspace(-1, 1, 100)}
    assert compare_runs({"output y": want["output y"] * (1 + 1e-6)}, want, FP32).ok
    bad = compare_runs({"output y": want["output y"] + 1e-2}, want, FP32)
    assert not bad.ok and "elements off" in bad.problem


def test_new_nan_fails_but_nan_where_original_had_one_is_ignored():
    want = torch.tensor([1.0, float("nan"), 3.0])
    assert compare_runs({"output y": torch.tensor([1.0, 5.0, 3.0])}, {"output y": want}, FP32).ok
    c = compare_runs({"output y": torch.tensor([1.0, 2.0, float("inf")])}, {"output y": want}, FP32)
    assert not c.ok and "non-finite" in c.problem


def test_every_non_finite_case_on_both_sides():
    finite = torch.tensor([1.0, -2.0, 3.0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        got = finite.clone()
        got[1] = bad
        c = compare_runs({"output y": got}, {"output y": finite}, FP32)
        assert not c.ok and "non-finite" in c.problem, bad
    # the same non-finite values on both sides are not compared; the finite ones still are
    want = torch.tensor([float("inf"), 2.0, float("nan")])
    assert compare_runs({"output y": want.clone()}, {"output y": want}, FP32).ok
    off = torch.tensor([float("inf"), 2.1, float("nan")])
    c = compare_runs({"output y": off}, {"output y": want}, FP32)
    assert not c.ok and "1 of 1 elements off" in c.problem  # of the finite ones
    # nothing finite to compare, and nothing at all
    assert compare_runs({"output y": torch.tensor([5.0])}, {"output y": torch.tensor([float("nan")])}, FP32).ok
    assert compare_runs({"output y": torch.zeros(0)}, {"output y": torch.zeros(0)}, FP32).ok
    # finite operands whose difference overflows are off, not "non-finite"
    big = torch.tensor([3e38, 1.0])
    c = compare_runs({"output y": -big}, {"output y": big}, FP32)
    assert not c.ok and "elements off" in c.problem


def test_the_relative_bound_applies_where_the_absolute_one_is_exceeded():
    want = torch.tensor([1000.0, 1.0])
    # 0.05 on 1000 is within rtol 1e-4 (0.1) though above atol (1e-5 * 1000 = 0.01)
    assert compare_runs({"output y": torch.tensor([1000.05, 1.0])}, {"output y": want}, FP32).ok
    # 0.05 on 1.0 is not
    c = compare_runs({"output y": torch.tensor([1000.0, 1.05])}, {"output y": want}, FP32)
    assert not c.ok and "1 of 2 elements off" in c.problem


def test_near_zero_gradient_is_judged_against_the_runs_scale():
    want = {"grad a": torch.full((4,), 1e-12), "grad b": torch.ones(4)}
    got = {"grad a": torch.full((4,), 4e-12), "grad b": torch.ones(4)}
    assert compare_runs(got, want, FP32).ok
    assert not compare_runs({"grad a": got["grad a"]}, {"grad a": want["grad a"]}, FP32).ok


def test_shape_and_integer_mismatches_fail():
    assert not compare_runs({"output y": torch.zeros(3)}, {"output y": torch.zeros(4)}, FP32).ok
    assert not compare_runs({"output i": torch.tensor([1, 2])}, {"output i": torch.tensor([1, 3])}, FP32).ok
    assert not compare_runs({}, {"output y": torch.zeros(1)}, FP32).ok


def test_half_precision_tolerances_are_looser():
    assert tolerance_for(torch.bfloat16).rtol > tolerance_for(torch.float16).rtol > FP32.rtol


def test_reduced_precision_is_judged_against_autocasts_own_error():
    """A cancelling sum (a norm weight's gradient) off by more than the bf16 bound passes when
    torch.autocast is off by as much; twice beyond autocast's error, or a new NaN, fails."""
    bf16 = tolerance_for(torch.bfloat16)
    want = {"grad w": torch.tensor([1.0, 1e-3, -1.0])}
    autocast = Yardstick("torch.autocast", {"grad w": torch.tensor([1.0, 1e-3 + 0.03, -1.0])}, 2.0)
    close = {"grad w": torch.tensor([1.0, 1e-3 + 0.05, -1.0])}
    far = {"grad w": torch.tensor([1.0, 1e-3 + 0.07, -1.0])}
    assert not compare_runs(close, want, bf16).ok  # beyond the elementwise bound on its own
    assert compare_runs(close, want, bf16, yardstick=autocast).ok
    c = compare_runs(far, want, bf16, yardstick=autocast)
    assert not c.ok and "the torch.autocast run deviates 3.000e-02" in c.problem
    nan = {"grad w": torch.tensor([1.0, float("nan"), -1.0])}
    assert not compare_runs(nan, want, bf16, yardstick=autocast).ok


class CancellingSum(torch.nn.Module):
    def forward(self, x):
        return torch.sum(x, -1)


class ReorderSum(rewriter.Pass):
    """Sums in reverse order: an exact rewrite that rounds differently (or ``shift`` off)."""

    contract = "exact"

    def __init__(self, name, shift=0.0):
        self.name, self.shift = name, shift

    def find(self, gm, ctx):
        return [rewriter.Site(n, n.name) for n in gm.graph.nodes if n.target is torch.sum]

    def apply(self, gm, sites, ctx):
        for site in sites:
            x = site.anchor.args[0]
            with gm.graph.inserting_before(site.anchor):
                flipped = gm.graph.call_function(torch.flip, (x, (-1,)))
            site.anchor.args = (flipped, *site.anchor.args[1:])
            if self.shift:
                with gm.graph.inserting_after(site.anchor):
                    shifted = gm.graph.call_function(torch.add, (site.anchor, self.shift))
                site.anchor.replace_all_uses_with(shifted)
                shifted.args = (site.anchor, self.shift)


def test_fp32_rounding_beyond_the_bound_is_judged_against_the_float64_run():
    """Rows of +-1e4 that cancel: summed in another order, fp32 differs by ~1e-2 from the
    original, beyond the elementwise bound, but no more than the original differs from the
    exact (float64) sum: kept. Off by 0.1 on top: rejected, the float64 run named."""
    torch.manual_seed(0)
    big = torch.randn(64, 1) * 1e4
    x = torch.cat([big, torch.randn(64, 30), -big, torch.randn(64, 30)], 1)
    fast = rewriter.optimize(CancellingSum(), (x,), passes=[ReorderSum("reorder"), ReorderSum("off", 0.1)],
                             clock=ControlledClock({"reorder": 0.5, "off": 0.5}), gate=QUICK,
                             progress=False, profile=False)
    reorder, off = fast.report.decisions[:2]
    assert reorder.kept, reorder.reason
    assert "within 4x of the float64 run's deviation" in reorder.verification
    assert off.status == "failed verification" and "the float64 run deviates" in off.reason


def test_dropout_disabled_makes_dropout_identity():
    x = torch.randn(100)
    with dropout_disabled():
        assert torch.equal(torch.nn.functional.dropout(x, 0.9, True), x)
        q = torch.randn(1, 1, 4, 8)
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.9)
    torch.testing.assert_close(a, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_flatten_output_reads_nested_structures_and_dataclasses():
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor
        extra: tuple

    t = torch.zeros(1)
    paths = [p for p, _ in flatten_output({"a": [t, (t, Out(t, (t,)))]})]
    assert paths == ["a[0]", "a[1][0]", "a[1][1].logits", "a[1][1].extra[0]"]


def test_backend_lookup():
    assert isinstance(get_backend("cpu"), CpuBackend)
    assert get_backend("cuda:0").name == "cuda"
    assert get_backend(torch.device("cpu")).name == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        get_backend("tpu")


def test_npu_backend_is_unavailable_without_torch_npu(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    assert not NpuBackend().is_available()
    assert get_backend(None).name in ("cpu", "cuda")


def test_optimize_end_to_end_on_the_npu_shim(fake_torch_npu):
    torch.manual_seed(0)
    model = HandAttention("masked_fill").train()
    x, keep = torch.randn(2, 16, 32), torch.tril(torch.ones(16, 16, dtype=torch.bool))
    fast = rewriter.optimize(model, (x, keep), device=NpuBackend(), gate=QUICK, progress=False,
                             clock=ControlledClock({"fuse_attention": 0.5}))
    assert fast.report.device == "npu" and fast.report.kept_passes == ["fuse_attention"]
    assert "npu_fusion_attention" in fast.graph_code()["graph_0"]
    assert fast.report.top_ops_before, fast.report.notes  # profiled via the shim


def test_float64_yardstick_copies_the_model_and_runs_on_the_host_for_npu(fake_torch_npu):
    from rewriter.decide.job import Job
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).train()
    job = Job(model, (torch.randn(2, 4),), {}, NpuBackend(), training=True)
    values = job.float64_numerics()
    assert values is not None and set(values) == {"output output", "grad 0.weight", "grad 0.bias"}
    assert all(v.dtype == torch.float64 and v.device.type == "cpu" for v in values.values())
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    fp32 = job.numerics(model)
    for k in fp32:
        torch.testing.assert_close(values[k].float(), fp32[k], rtol=1e-5, atol=1e-6)


def test_cpuinfo_flags_are_read_on_x86_and_on_arm():
    from benchmarks.measure import _isa
    from rewriter.devices.cpu_identity import parse_cpuinfo
    x86 = ["processor\t: 0", "model name\t: Intel(R) Xeon(R) Platinum 8480+",
           "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16", "", "processor\t: 1",
           "model name\t: other", "flags\t\t: fpu"]
    name, flags = parse_cpuinfo(x86)
    assert name == "Intel(R) Xeon(R) Platinum 8480+" and "amx_bf16" in flags and "fpu" in flags
    assert _isa(flags) == {"avx512": True, "avx512_bf16": True, "amx_bf16": True}
    # aarch64 names its ISA extensions on a "Features" line, and often no model name
    arm = ["processor\t: 0", "BogoMIPS\t: 2100.00",
           "Features\t: fp asimd evtstrm aes sve asimddp bf16 i8mm", "CPU implementer\t: 0x41"]
    name, flags = parse_cpuinfo(arm)
    assert name == "" and {"sve", "bf16"} <= flags
    assert _isa(flags) == {"sve": True, "bf16": True, "i8mm": True}
    assert _isa(frozenset()) == {}


def test_an_x86_cpus_name_carries_its_family_and_model_so_two_generations_named_alike_differ():
    from rewriter.devices.cpu_identity import parse_cpuinfo

    def cpu(family, model):
        return ["processor\t: 0", "vendor_id\t: AuthenticAMD", f"cpu family\t: {family}",
                f"model\t\t: {model}", "model name\t: AMD EPYC", "flags\t\t: fpu avx512f", "",
                "processor\t: 1", "cpu family\t: 1", "model\t\t: 1", "model name\t: other"]
    zen4, zen5 = parse_cpuinfo(cpu(25, 17))[0], parse_cpuinfo(cpu(26, 2))[0]
    assert zen4 == "AMD EPYC (family 25, model 17)" and zen5 == "AMD EPYC (family 26, model 2)"
    # 32-bit ARM names its board on a "Hardware" line after every processor's block
    arm = ["processor\t: 0", "model\t\t: 0", "Features\t: half thumb vfp", "", "processor\t: 1",
           "Features\t: half thumb vfp", "", "Hardware\t: BCM2835"]
    assert parse_cpuinfo(arm)[0] == "BCM2835"
