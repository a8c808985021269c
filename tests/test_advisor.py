"""The advisor's rules on hand-built profiles: each fires on its hot spot, stays quiet without
it, and names the pass of this project that addresses it."""
import pytest

from rewriter.profile.advisor import AdvisorSettings, advise, findings_to_markdown
from rewriter.profiling import KernelRow, OpRow, ProfileResult

KNOWN_PASSES = {"fuse_attention", "fuse_linear", "fuse_optimizer", "make_contiguous", "narrow_int64",
                "pad_to_alignment", "cast_to_half", "fuse_rms_norm", "fuse_gelu", "fuse_swiglu",
                "fuse_rotary_embedding"}


def _profile(rows=(), *, sequence=(), kernels=(), device="cpu", steps=1, wall_ms=None, shape_rows=()):
    """rows: (name, calls, self_ms[, total_ms[, input_shapes]]); shares of their summed self time."""
    rows = [r + (r[2],) if len(r) == 3 else r for r in rows]
    total = sum(r[2] for r in rows) or 1.0
    ops = [OpRow(r[0], r[1], r[2], r[3], r[2] / total, r[4] if len(r) > 4 else ()) for r in rows]
    shapes = [OpRow(n, c, ms, ms, ms / total, (sig,)) for n, c, ms, sig in shape_rows]
    return ProfileResult("p", device, steps, sorted(ops, key=lambda r: -r.self_ms), shapes,
                         list(kernels), tuple(sequence), wall_ms)


def _rules(profile, **settings):
    return {f.rule: f for f in advise(profile, settings=AdvisorSettings(**settings))}


FILLER = ("aten::addmm", 10, 50.0)  # a step mostly spent in well-behaved GEMMs


# --- AI CPU (NPU) ------------------------------------------------------------------------------

def test_int64_operator_on_ai_cpu_names_narrow_int64():
    kernels = [KernelRow("Equal", "AI_CPU", 4, 0.2, ("INT64", "INT64")),  # 50 us per call
               KernelRow("MatMul", "AI_CORE", 10, 5.0, ("FLOAT16", "FLOAT16"))]
    f = _rules(_profile([FILLER], kernels=kernels, device="npu"))["ai_cpu"]
    assert f.passes == ("narrow_int64",) and f.operators == ("Equal",)
    assert f.share == pytest.approx(0.2 / 5.2) and "INT64" in f.detail


def test_ai_cpu_rule_keeps_msprofs_20us_floor_and_needs_ai_cpu():
    short = [KernelRow("Equal", "AI_CPU", 10, 0.1, ("INT64",))]  # 10 us per call
    assert "ai_cpu" not in _rules(_profile([FILLER], kernels=short, device="npu"))
    assert "ai_cpu" in _rules(_profile([FILLER], kernels=short, device="npu"), aicpu_min_us=5)
    core = [KernelRow("Equal", "AI_CORE", 1, 1.0, ("INT64",))]
    assert "ai_cpu" not in _rules(_profile([FILLER], kernels=core, device="npu"))


def test_ai_cpu_without_int64_does_not_claim_narrow_int64():
    f = _rules(_profile([FILLER], kernels=[KernelRow("Mul", "AI_CPU", 1, 1.0, ("DOUBLE",))]))["ai_cpu"]
    assert f.passes == () and "double" in f.detail


# --- non-contiguous memory -------------------------------------------------------------------

def test_time_in_contiguous_and_copy_names_make_contiguous():
    p = _profile([FILLER, ("aten::contiguous", 40, 0.5, 8.0), ("aten::copy_", 40, 7.5)])
    f = _rules(p)["non_contiguous"]
    assert f.passes == ("make_contiguous",) and f.share == pytest.approx(8.0 / 58.0)
    assert "40 calls" in f.detail


def test_npu_contiguous_events_count_and_small_copies_do_not():
    p = _profile([FILLER, ("contiguous_d_AsStrided", 30, 6.0)], device="npu")
    assert "non_contiguous" in _rules(p)
    assert "non_contiguous" not in _rules(_profile([FILLER, ("aten::copy_", 4, 0.5)]))


# --- unfused attention -----------------------------------------------------------------------

EAGER_ATTENTION = "transpose matmul mul add softmax to dropout matmul transpose reshape".split()


def test_unfused_attention_is_found_in_the_operator_sequence():
    p = _profile([FILLER, ("aten::bmm", 4, 5.0), ("aten::_softmax", 2, 3.0)],
                 sequence=EAGER_ATTENTION * 4, steps=2)
    f = _rules(p)["unfused_attention"]
    assert f.passes == ("fuse_attention",) and "2 attention block(s) per step" in f.detail
    assert f.share == pytest.approx(8.0 / 58.0)


@pytest.mark.parametrize("sequence", [
    "transpose scaled_dot_product_attention transpose reshape",  # fused
    "bmm bmm _softmax_backward_data bmm bmm",                       # backward of attention only
    "matmul add softmax",                                           # softmax with no second matmul
])
def test_no_attention_finding_without_the_pattern(sequence):
    p = _profile([FILLER, ("aten::softmax", 1, 1.0)], sequence=sequence.split())
    assert "unfused_attention" not in _rules(p)


def test_a_bare_table_infers_attention_from_softmax_and_bmm():
    rows = [OpRow("aten::bmm", 4, 2.0, 2.0, 0.2), OpRow("aten::softmax", 2, 1.0, 1.0, 0.1)]
    assert [f.rule for f in advise(rows)] == ["unfused_attention"]
    fused = rows + [OpRow("aten::_scaled_dot_product_flash_attention_for_cpu", 2, 1.0, 1.0, 0.1)]
    assert advise(fused) == []


def test_sdpa_math_fallback_is_reported():
    p = _profile([FILLER, ("aten::_scaled_dot_product_attention_math", 2, 1.0, 9.0)],
                 sequence=["scaled_dot_product_attention"])
    f = _rules(p)["attention_math_fallback"]
    assert "unfused_attention" not in _rules(p) and "math fallback" in f.detail


# --- many tiny operators -----------------------------------------------------------------------

def test_many_tiny_operators_point_at_the_fusion_passes():
    # 300 calls of 2 us and 100 of 5 us = 1.1 ms of a 2.1 ms step
    p = _profile([("aten::view", 300, 0.6), ("aten::add", 100, 0.5), ("aten::addmm", 2, 1.0)])
    f = _rules(p)["tiny_operators"]
    assert "400 of 402 operator calls" in f.detail and f.share == pytest.approx(1.1 / 2.1)
    assert "fuse_optimizer" in f.passes and "fuse_attention" in f.passes


def test_few_or_cheap_tiny_operators_are_no_finding():
    assert "tiny_operators" not in _rules(_profile([("aten::view", 50, 0.1), FILLER]))  # too few
    assert "tiny_operators" not in _rules(_profile([("aten::view", 300, 0.6), FILLER]))  # 1% share


# --- optimizer step --------------------------------------------------------------------------

def test_optimizer_share_of_the_step_wall_time():
    p = _profile([FILLER, ("Optimizer.step#AdamW.step", 1, 0.5, 15.0)], wall_ms=60.0)
    f = _rules(p)["optimizer_step"]
    assert f.passes == ("fuse_optimizer",) and f.share == pytest.approx(0.25) and "AdamW" in f.detail


def test_small_or_already_fused_optimizer_is_no_finding():
    assert "optimizer_step" not in _rules(_profile([FILLER, ("Optimizer.step#AdamW.step", 1, 0.1, 2.0)],
                                                   wall_ms=60.0))
    fused = _profile([FILLER, ("Optimizer.step#NpuFusedAdamW.step", 1, 1, 30.0)], wall_ms=60.0, device="npu")
    assert "optimizer_step" not in _rules(fused)


# --- MatMul alignment ------------------------------------------------------------------------

VOCAB_HEAD = ("aten::addmm", 1, 20.0, ((50257,), (8, 768), (768, 50257), (), ()))
ALIGNED = ("aten::mm", 1, 20.0, ((8, 768), (768, 1024)))


def test_unaligned_matmul_on_npu_names_pad_to_alignment():
    p = _profile([FILLER], shape_rows=[VOCAB_HEAD, ALIGNED], device="npu")
    f = _rules(p)["matmul_alignment"]
    assert f.passes == ("pad_to_alignment",) and "50257" in f.detail and "of 16" in f.detail
    assert f.operators == ("aten::addmm",)


def test_alignment_follows_the_device_or_the_setting():
    cpu = _profile([FILLER], shape_rows=[VOCAB_HEAD])
    f = _rules(cpu)["matmul_alignment"]  # a CPU declares none: the pass's candidate 16, gated
    assert "of 16" in f.detail and "the gate decides" in f.detail and "NPU/CUDA" in f.title
    assert "of 64" in _rules(cpu, matmul_alignment=64)["matmul_alignment"].detail
    aligned = _profile([FILLER], shape_rows=[ALIGNED], device="npu")
    assert "matmul_alignment" not in _rules(aligned)


# --- affinity patterns (§4.2) ----------------------------------------------------------------

@pytest.mark.parametrize("rule, sequence, pass_name", [
    ("unfused_gelu", "view addmm view mul pow mul add mul tanh add mul view", "fuse_gelu"),
    ("unfused_rms_norm", "to pow mean add rsqrt mul to mul", "fuse_rms_norm"),
    ("unfused_swiglu", "linear silu linear mul linear", "fuse_swiglu"),
    ("unfused_rotary_embedding", "mul slice slice neg cat mul add", "fuse_rotary_embedding"),
    ("unfused_linear", "t matmul add relu", "fuse_linear"),
])
def test_affinity_patterns_name_their_pass(rule, sequence, pass_name):
    f = _rules(_profile([FILLER], sequence=sequence.split()))[rule]
    assert f.passes == (pass_name,) and "1 site(s) per step" in f.detail


def test_fused_forms_match_no_affinity_pattern():
    fused = "gelu rms_norm layer_norm linear silu scaled_dot_product_attention".split()
    assert advise(_profile([FILLER], sequence=fused)) == []


# --- the whole --------------------------------------------------------------------------------

def test_findings_are_sorted_by_share_and_name_known_passes():
    p = _profile([FILLER, ("aten::bmm", 4, 5.0), ("aten::softmax", 2, 3.0),
                  ("aten::contiguous", 40, 0.5, 12.0), ("Optimizer.step#SGD.step", 1, 1.0, 9.0)],
                 sequence=EAGER_ATTENTION + "mul pow mul add mul tanh add mul".split(), wall_ms=60.0)
    findings = advise(p)
    assert [f.rule for f in findings] == ["non_contiguous", "optimizer_step", "unfused_attention",
                                          "unfused_gelu"]
    assert all(f.passes and set(f.passes) <= KNOWN_PASSES for f in findings)
    md = findings_to_markdown(findings)
    assert md.startswith("### Advisor") and "Pass: `fuse_attention`." in md
    assert findings[0].to_dict()["share"] == round(findings[0].share, 4)


# --- page faults (CPU host allocator) ---------------------------------------------------------

def _faulting(n, device="cpu"):
    p = _profile([FILLER], device=device)
    p.page_faults = n
    return p


def test_page_faults_in_every_step_are_a_finding_on_cpu_only():
    f = _rules(_faulting(20_000))["page_faults"]
    assert "20000 page faults in every step" in f.detail and "MALLOC_TRIM_THRESHOLD_" in f.detail
    assert "MALLOC_MMAP_MAX_=0" in f.detail  # no mmap at any size: a threshold is capped at 32 MiB
    assert f.passes == ()  # the process's allocator settings, not a rewrite
    assert "Pass: none: the process's allocator settings" in findings_to_markdown([f])
    assert "page_faults" not in _rules(_faulting(4_999))  # under the setting's 5000
    assert "page_faults" in _rules(_faulting(4_999), page_faults=1000)
    assert "page_faults" not in _rules(_faulting(20_000, device="cuda"))  # device memory: cached
    assert "page_faults" not in _rules(_faulting(None))  # a platform that does not count them


def test_quiet_profile_and_bad_input():
    assert findings_to_markdown(advise(_profile([FILLER]))) == "### Advisor\n\nNo known hot spot found.\n"
    with pytest.raises(ValueError, match="ProfileResult or a list of OpRow"):
        advise([{"name": "aten::mm"}])
