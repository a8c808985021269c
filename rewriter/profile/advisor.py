"""Advisor: known hot spots in a profile, in words, each naming the pass of this project that
addresses it, the way the Ascend profiling advisor (msprof-analyze, reference §4) does::

    from rewriter import profiling
    from rewriter.profile.advisor import advise, findings_to_markdown

    result = profiling.profile_model(model, (x,), training=True, optimizer=opt)
    for f in advise(result):
        print(f.title, f.passes)          # e.g. "Unfused attention" ('fuse_attention',)
    print(findings_to_markdown(advise(result)))

Rules (thresholds in :class:`AdvisorSettings`):

=========================  ==============================================  ====================
rule                       detects                                          pass
=========================  ==============================================  ====================
ai_cpu                     NPU kernels on AI CPU (int64 inputs, §4.1)       narrow_int64
non_contiguous             time in ``contiguous``/``copy_``                 make_contiguous
unfused_attention          matmul -> softmax -> matmul (bmm+softmax+bmm)    fuse_attention
attention_math_fallback    SDPA running its (unfused) math kernel           fuse_attention
tiny_operators             many operators of a few microseconds each        the fusion passes
optimizer_step             ``optimizer.step()``'s share of the step         fuse_optimizer
matmul_alignment           MatMul dims not a multiple of the device's       pad_to_alignment
                           (CPU: the pass's candidate 16, gated), with
                           the model line of each shape
transposed_matmul          a heavy GEMM whose model line transposes an      fuse_linear,
                           operand (``x @ w.t()``)                          make_contiguous
shape_outliers             a shape whose time per FLOP is far above the     pad_to_alignment,
                           operator's other shapes (roofline analysis)      make_contiguous,
                                                                            fuse_linear,
                                                                            cast_to_half
unfused_gelu/_rms_norm/    the affinity patterns of §4.2, written for       fuse_gelu, ...
_swiglu/_rotary/_linear    torch's operator names
page_faults                CPU: memory the host allocator hands back to     none (the process's
                           the system and maps again in every step          allocator settings)
=========================  ==============================================  ====================

Sequence rules read the profile's top-level operators in time order; given only a table (a
list of OpRow), unfused attention is inferred from softmax and bmm rows instead.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from rewriter.devices.backends import get_backend
from rewriter.devices.host_memory import FRESH_PAGES_WORTH_A_NOTE, pages_mib
from rewriter.profile.op_analysis import OpAnalysis
from rewriter.profile.roofline import RooflineRow, describe_origins
from rewriter.profile.rows import KernelRow, OpRow, ProfileLike, is_profile

__all__ = ["AdvisorSettings", "Finding", "advise", "findings_to_markdown"]


@dataclass(frozen=True)
class AdvisorSettings:
    """Thresholds; shares are fractions of the step's operator self time."""

    copy_share: float = 0.05  # contiguous/copy_ time worth a finding
    optimizer_share: float = 0.10  # optimizer.step() of the step's wall time
    tiny_op_us: float = 10.0  # an operator averaging less per call is "tiny"
    tiny_min_calls: int = 200  # tiny operator calls per step ...
    tiny_share: float = 0.20  # ... taking at least this share
    aicpu_min_us: float = 20.0  # msprof's AI CPU rule: tasks of 20 us or more (§4.1)
    matmul_alignment: int | None = None  # None: the profiled device's (NPU 16, CUDA 8; CPU 16, gated)
    matmul_share: float = 0.01
    transposed_share: float = 0.05  # GEMM time at a line with a transposed operand
    # page faults in every step worth a finding (rewriter.devices.host_memory)
    page_faults: int = FRESH_PAGES_WORTH_A_NOTE


@dataclass(frozen=True)
class Finding:
    """One hot spot: what, how much of the step, in words, and the passes that address it."""

    rule: str
    title: str
    detail: str
    passes: tuple[str, ...]
    share: float = 0.0  # of the step, where the finding has a time
    operators: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()  # the model lines involved ("Block.forward model.py:7")
    outside: str = ""  # with no pass: what addresses it instead

    def to_dict(self) -> dict:
        d = asdict(self)
        d["share"] = round(self.share, 4)
        return d


@dataclass
class _View:
    """What the rules read, from a ProfileResult or a bare table."""

    rows: list[OpRow]
    shape_rows: list[OpRow]
    kernels: list[KernelRow]
    sequence: tuple[str, ...]
    device: str
    steps: int
    wall_ms: float | None
    analysis: OpAnalysis | None = None
    page_faults: int | None = None

    @property
    def step_ms(self) -> float:
        # A cut table (top k) still knows the step through any row's share.
        ref = next((r for r in self.rows if r.share > 0), None)
        return ref.self_ms / ref.share if ref else sum(r.self_ms for r in self.rows)

    def rows_named(self, *names: str) -> list[OpRow]:
        return [r for r in self.rows if r.name in names]


def _view(profile: ProfileLike | Sequence[OpRow], device: str | None) -> _View:
    if is_profile(profile):
        return _View(profile.rows, profile.shape_rows, profile.kernels, profile.sequence,
                     device or profile.device, profile.steps, profile.wall_ms, profile.analysis,
                     profile.page_faults)
    rows = list(profile)
    if not all(isinstance(r, OpRow) for r in rows):
        raise ValueError("advise() takes a ProfileResult or a list of OpRow")
    return _View(rows, [], [], (), device or "cpu", 1, None)


def _ms(x: float) -> str:
    return f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms"


# --- rules -----------------------------------------------------------------------------------

def _ai_cpu(v: _View, s: AdvisorSettings) -> Finding | None:
    """NPU kernels that ran on AI CPU; int64 inputs are the usual cause (msprof aicpu rules)."""
    slow = [k for k in v.kernels if k.accelerator_core == "AI_CPU" and k.calls
            and 1e3 * k.duration_ms / k.calls >= s.aicpu_min_us]
    if not slow:
        return None
    int64 = [k for k in slow if any("int64" in d.lower() for d in k.input_dtypes)]
    device_ms = sum(k.duration_ms for k in v.kernels) or 1.0
    ms = sum(k.duration_ms for k in slow)
    listed = ", ".join(f"{k.type} ({'/'.join(k.input_dtypes) or '?'}, {k.calls} calls, {_ms(k.duration_ms)})"
                       for k in slow[:5])
    detail = (f"{len(slow)} kernel type(s) ran on AI CPU instead of AI Core: {listed}; "
              f"{_ms(ms)} per step, {100 * ms / device_ms:.1f}% of device time. ")
    if int64:
        detail += ("AI Core has no int64 path for these; narrowing int64 tensors to int32 "
                   "(where values fit) moves them back.")
    else:
        detail += "No int64 input among them: check the dtype (double runs on AI CPU; use float)."
    return Finding("ai_cpu", "Operators falling back to AI CPU" + (" (int64)" if int64 else ""),
                   detail, ("narrow_int64",) if int64 else (), ms / device_ms, tuple(k.type for k in slow))


_CONTIGUOUS_PREFIXES = ("contiguous_d_", "contiguous_h_")  # torch_npu framework events (§3.3)


def _non_contiguous(v: _View, s: AdvisorSettings) -> Finding | None:
    step = v.step_ms or 1.0
    made_contiguous = [r for r in v.rows
                       if r.name == "aten::contiguous" or r.name.startswith(_CONTIGUOUS_PREFIXES)]
    contiguous_ms = sum(r.total_ms if r.name == "aten::contiguous" else r.self_ms for r in made_contiguous)
    copy = v.rows_named("aten::copy_")
    copy_ms = sum(r.self_ms for r in copy)
    share = max(contiguous_ms, copy_ms) / step
    if share < s.copy_share:
        return None
    calls = sum(r.calls for r in made_contiguous)
    detail = (f"Copying memory takes {100 * share:.1f}% of the step: aten::copy_ {_ms(copy_ms)} "
              f"({sum(r.calls for r in copy)} calls); making tensors contiguous {_ms(contiguous_ms)} "
              f"({calls} calls). A transposed, permuted or expanded tensor is copied to dense memory "
              "before a kernel that needs it (on NPU: contiguous_d_* events, AsStrided the slow "
              "path). copy_ also carries dtype casts (aten::to).")
    return Finding("non_contiguous", "Time in contiguous/copy_ (non-contiguous memory)", detail,
                   ("make_contiguous",), share, tuple(r.name for r in made_contiguous + copy))


# An attention block as the Ascend advisor sees it (§4.2: matmul-[add]-[mul]-[mask]-softmax-
# [dropout]-matmul), loosened for torch: up to 8 scaling/mask/cast ops before the softmax, 4 after.
_ATTENTION = r"(?:matmul|bmm|einsum) (?:\S+ ){0,8}?softmax (?:\S+ ){0,4}?(?:matmul|bmm|einsum)"
_FUSED_ATTENTION = ("scaled_dot_product", "flash_attention", "fusion_attention", "efficient_attention")


def _count(pattern: str, sequence: tuple[str, ...]) -> int:
    """Non-overlapping matches of a space-separated token pattern over the operator sequence."""
    text = " " + " ".join(sequence) + " "
    return len(re.findall(r"(?<= )" + pattern + r"(?= )", text))


def _unfused_attention(v: _View, s: AdvisorSettings) -> Finding | None:
    parts = v.rows_named("aten::softmax", "aten::_softmax", "aten::_softmax_backward_data", "aten::bmm")
    share = sum(r.share for r in parts) if any(r.share for r in parts) else 0.0
    if v.sequence:
        blocks = _count(_ATTENTION, v.sequence) / max(v.steps, 1)
        if not blocks:
            return None
        found = (f"{blocks:g} attention block(s) per step run as separate matmul -> softmax -> "
                 "matmul operators")
    else:
        fused = any(k in r.name for r in v.rows for k in _FUSED_ATTENTION)
        softmax = v.rows_named("aten::softmax", "aten::_softmax")
        if fused or not softmax or not v.rows_named("aten::bmm", "aten::matmul"):
            return None
        found = f"softmax ({softmax[0].calls} calls per step) between batched matmuls, no fused attention"
    detail = (f"{found} (bmm + softmax + bmm): the (batch, heads, seq, seq) score matrix is written "
              f"and read back. softmax and bmm take {100 * share:.1f}% of the step. A fused "
              "attention kernel (SDPA; npu_fusion_attention on NPU) never materialises it.")
    return Finding("unfused_attention", "Unfused attention", detail, ("fuse_attention",), share,
                   tuple(r.name for r in parts))


def _attention_math_fallback(v: _View, s: AdvisorSettings) -> Finding | None:
    """Fused attention on the graph, but SDPA chose its math kernel, which is unfused inside."""
    math_rows = v.rows_named("aten::_scaled_dot_product_attention_math")
    if not math_rows:
        return None
    share = sum(r.total_ms for r in math_rows) / (v.step_ms or 1.0)
    detail = (f"scaled_dot_product_attention ran its math fallback ({math_rows[0].calls} calls per "
              f"step, {100 * share:.1f}% of the step), which still materialises the score matrix: "
              "no flash kernel takes these inputs here (on CPU: attention dropout in training; "
              "elsewhere also masks, dtypes or head sizes the kernels refuse). The gate keeps "
              "fuse_attention only where it measured faster.")
    return Finding("attention_math_fallback", "Fused attention on its math fallback", detail,
                   ("fuse_attention",), share, tuple(r.name for r in math_rows))


_FUSIONS = ("fuse_attention", "fuse_gelu", "fuse_rms_norm", "fuse_swiglu", "fuse_rotary_embedding",
            "fuse_linear", "fuse_optimizer")


def _tiny_operators(v: _View, s: AdvisorSettings) -> Finding | None:
    ops = [r for r in v.rows if r.name.startswith(("aten::", "npu::")) and r.calls]
    tiny = [r for r in ops if 1e3 * r.self_ms / r.calls < s.tiny_op_us]
    calls = sum(r.calls for r in tiny)
    share = sum(r.share for r in tiny)
    if calls < s.tiny_min_calls or share < s.tiny_share:
        return None
    most = sorted(tiny, key=lambda r: r.calls, reverse=True)[:5]
    detail = (f"{calls} of {sum(r.calls for r in ops)} operator calls per step average under "
              f"{s.tiny_op_us:g} us each and together take {100 * share:.1f}% of the step: launch "
              "and dispatch overhead, not arithmetic, is their cost (most called: "
              + ", ".join(f"{r.name} x{r.calls}" for r in most)
              + "). Fusing operators cuts the count; the fused optimizer cuts the update's.")
    return Finding("tiny_operators", "Many tiny operators (dispatch overhead)", detail, _FUSIONS,
                   share, tuple(r.name for r in most))


def _optimizer_step(v: _View, s: AdvisorSettings) -> Finding | None:
    steps = [r for r in v.rows if r.name.startswith("Optimizer.step#")]
    if not steps:
        return None
    ms = sum(r.total_ms for r in steps)
    share = ms / (v.wall_ms or v.step_ms or 1.0)
    classes = sorted({r.name.split("#", 1)[1].split(".")[0] for r in steps})
    if share < s.optimizer_share or all(c.startswith("NpuFused") for c in classes):
        return None
    detail = (f"optimizer.step() ({', '.join(classes)}) takes {100 * share:.1f}% of the step "
              f"({_ms(ms)}). Its per-parameter loop launches several small operators per tensor; "
              "the fused (or foreach) implementation updates all parameters in a few kernels "
              "(torch fused=True; torch_npu NpuFused* on NPU). If it is already fused, this is "
              "the update's own arithmetic.")
    return Finding("optimizer_step", "Optimizer step's share", detail, ("fuse_optimizer",), share,
                   tuple(r.name for r in steps))


def _page_faults(v: _View, s: AdvisorSettings) -> Finding | None:
    """Large CPU tensors come from glibc malloc's mmap, or from a heap it trims: freed, they go
    back to the system, and the next step's are fresh pages the kernel zeroes on first touch.
    How many depends on the process's history (malloc's mmap threshold adapts), which also
    moves one region's timing from run to run (written-out attention, training, 4 x 4 x 256 x 64:
    13.6 ms when nothing is returned, 38 ms when everything is). GPT-2 training, 4 layers,
    batch 4 x 256, 2-core Xeon without AMX, one process per setting (`.diag/faults.py`):
    default glibc 8000-34000 faults a step, 180-211 ms; ``MALLOC_MMAP_MAX_=0`` with
    ``MALLOC_TRIM_THRESHOLD_=16 GiB`` 0-1 faults, 175-187 ms (so with
    ``MALLOC_MMAP_THRESHOLD_=2000000000``: glibc 2.36 does not cap it); ``MALLOC_MMAP_MAX_=0``
    alone 8000-24000 (the heap is trimmed)."""
    if v.device != "cpu" or v.page_faults is None or v.page_faults < s.page_faults:
        return None
    mib = pages_mib(v.page_faults)  # this machine's page size (the profile's, unless moved)
    detail = (f"{v.page_faults} page faults in every step ({mib:.0f} MiB of fresh pages): the "
              "host allocator hands large freed tensors back to the system and maps them again "
              "the next step. Start the process with MALLOC_MMAP_MAX_=0 (glibc: no block of any "
              "size mapped on its own; or MALLOC_MMAP_THRESHOLD_ above the largest tensor's bytes, "
              "where the release does not cap it at 32 MiB) and MALLOC_TRIM_THRESHOLD_ above the "
              "step's peak bytes (the freed heap kept), both: either alone leaves faults (check "
              "they drop), or with jemalloc or tcmalloc preloaded (LD_PRELOAD); in a running "
              "process, rewriter.keep_freed_host_memory() sets the same (glibc, up to 2 GiB kept).")
    return Finding("page_faults", "Memory mapped afresh every step", detail, (),
                   outside="the process's allocator settings; optimize() does not change a "
                           "running process's allocator unasked")


def _matmul_dims(name: str, sig: tuple) -> tuple[int, ...]:
    """(K, N) of a MatMul call from its input shapes; () when they do not say."""
    op = name.split("::")[-1]
    first = {"mm": 0, "bmm": 0, "matmul": 0, "addmm": 1, "baddbmm": 1, "linear": 0}.get(op)
    if first is None or len(sig) < first + 2:
        return ()
    a, b = sig[first], sig[first + 1]
    if not a or not b:
        return ()
    if op == "linear":  # weight is (N, K)
        return (a[-1], b[0])
    return (a[-1], b[-1]) if len(b) >= 2 else (a[-1],)


_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")  # the kernels matmul/linear call


# The pass's own candidate on a CPU, which declares no alignment (passes/pad_to_alignment.py).
CPU_CANDIDATE_ALIGNMENT = 16
NPU_PREFERRED_ALIGNMENT = 128  # the tuning guide: large dims in multiples of 128 run best


def _next_multiple(d: int, align: int) -> int:
    return -(-d // align) * align


def _origin_of(v: _View, name: str, sig: tuple) -> RooflineRow | None:
    return v.analysis.shape_row(name, sig) if v.analysis is not None else None


def _matmul_alignment(v: _View, s: AdvisorSettings) -> Finding | None:
    align = s.matmul_alignment or get_backend(v.device).matmul_alignment
    on_cpu = align <= 1
    if on_cpu:
        align = CPU_CANDIDATE_ALIGNMENT
    table = v.shape_rows or v.rows
    bad = []
    for r in table:
        if r.name in _MATMULS:
            for sig in r.input_shapes[:1]:
                kn = _matmul_dims(r.name, sig)
                dims = {d for d in kn if d % align}
                if dims:
                    bad.append((r, sig, kn, dims))
    share = sum(r.share for r, *_ in bad)
    if not bad or share < s.matmul_share:
        return None
    dims = sorted(set().union(*(d for *_, d in bad)))
    sources: list[str] = []
    lines = []
    for r, sig, kn, misaligned in sorted(bad, key=lambda b: -b[0].share)[:4]:
        names = [f"{label}={d}" for label, d in zip(("K", "N"), kn) if d in misaligned]
        where = _origin_of(v, r.name, sig)
        line = f"`{r.name}` {', '.join('x'.join(map(str, t)) for t in sig if t)}: {', '.join(names)}"
        if where is not None and where.origins:
            line += f", from {describe_origins(where.origins)}"
            sources += [o.where for o, *_ in where.origins[:1]]
        lines.append(line)
    to = "; ".join(f"{d} -> {_next_multiple(d, align)} (x{NPU_PREFERRED_ALIGNMENT}: "
                   f"{_next_multiple(d, NPU_PREFERRED_ALIGNMENT)})" for d in dims[:4])
    device_note = (f"On this CPU {align} is the pass's candidate (a 64-byte line of fp32) and the "
                   "gate decides; on an NPU this is the Cube unit's known slow path (16x16 fractals; "
                   "msprof-analyze wants the inner axis a multiple of 256, §4.1), on CUDA tensor "
                   "cores want multiples of 8.") if on_cpu else (
                   "The NPU Cube unit computes 16x16 fractals and msprof-analyze wants the inner axis "
                   "a multiple of 256 (§4.1); the tuning guide says multiples of 128 run best.")
    detail = (f"MatMuls whose inner (K) or output (N) dimension is not a multiple of {align} take "
              f"{100 * share:.1f}% of the step: {'; '.join(lines)}. Padding to the next multiple "
              f"({to}) keeps MatMuls on the fast path. {device_note} pad_to_alignment pads in the "
              "graph (parameters untouched); changing the model's hidden size is the other fix.")
    return Finding("matmul_alignment", f"MatMul shapes not aligned to {align}"
                   + (" (NPU/CUDA layout tip)" if on_cpu else ""), detail, ("pad_to_alignment",),
                   share, tuple(dict.fromkeys(r.name for r, *_ in bad)), tuple(dict.fromkeys(sources)))


_TRANSPOSED = re.compile(r"\.t\(\)|\.T\b|\.mT\b|transpose\(|permute\(")


def _transposed_matmul(v: _View, s: AdvisorSettings) -> Finding | None:
    """Heavy GEMMs whose model line transposes an operand (the case study's x @ w.t())."""
    if v.analysis is None:
        return None
    hits: dict[str, float] = {}
    codes: dict[str, str] = {}
    for r in v.analysis.rows:
        if r.kind != "gemm":
            continue
        for origin, _, _, part in r.origins:
            if _TRANSPOSED.search(origin.code):
                hits[origin.where] = hits.get(origin.where, 0.0) + r.share * part
                codes[origin.where] = origin.code
    share = sum(hits.values())
    if not hits or share < s.transposed_share:
        return None
    listed = "; ".join(f"{w} `{codes[w]}` ({100 * sh:.1f}%)" for w, sh in sorted(hits.items(), key=lambda x: -x[1]))
    detail = (f"GEMMs at lines that transpose an operand take {100 * share:.1f}% of the step "
              f"(forward and backward): {listed}. A transposed view is strided memory: on the NPU "
              "it becomes a contiguous_d_Transpose copy or a slower MatMul path. fuse_linear turns "
              "matmul(x, w.t()) (+ b) into one F.linear that reads w as stored; make_contiguous "
              "copies a transposed activation once for all its readers.")
    return Finding("transposed_matmul", "MatMul of a transposed operand", detail,
                   ("fuse_linear", "make_contiguous"), share, (), tuple(hits))


def _shape_outliers(v: _View, s: AdvisorSettings) -> Finding | None:
    """Shapes whose time per FLOP is far above their operator's other shapes."""
    if v.analysis is None or not v.analysis.outliers:
        return None
    backend = get_backend(v.device)
    align = s.matmul_alignment or backend.matmul_alignment
    align = CPU_CANDIDATE_ALIGNMENT if align <= 1 else align
    passes: list[str] = []
    parts = []
    for o in v.analysis.outliers[:5]:
        r = o.row
        why = []
        sig = r.signature or ()
        if r.kind == "gemm":
            kn = _matmul_dims(r.name, sig) or tuple(d for t in sig[-1:] for d in t[-1:])
            bad = [d for d in kn if d % align]
            if bad:
                why.append(f"dims {', '.join(map(str, bad))} not multiples of {align}")
                passes.append("pad_to_alignment")
        code = r.origins[0][0].code if r.origins else ""
        if _TRANSPOSED.search(code):
            why.append("a transposed operand")
            passes += ["make_contiguous"] + (["fuse_linear"] if r.kind == "gemm" else [])
        if r.kind in ("gemm", "conv", "attention") and r.dtype in ("float", "FLOAT") and backend.amp_dtypes \
                and backend.name != "cpu":
            why.append("fp32 where the device has a faster half-precision unit")
            passes.append("cast_to_half")
        shapes = ", ".join("x".join(map(str, t)) for t in sig if t)
        text = (f"`{r.name}` at {shapes}: {o.ratio:.1f}x the time per FLOP of its other shapes, "
                f"{100 * r.share:.1f}% of the step")
        if r.origins:
            text += f", from {describe_origins(r.origins)}"
        text += f" ({'; '.join(why)})" if why else " (no layout cause visible: try AOE tuning on NPU)"
        parts.append(text)
    share = sum(o.row.share for o in v.analysis.outliers)
    sources = tuple(dict.fromkeys(o.row.origins[0][0].where for o in v.analysis.outliers if o.row.origins))
    detail = "Shape outliers: " + "; ".join(parts) + "."
    return Finding("shape_outliers", "Shapes far slower per FLOP than their operator's others", detail,
                   tuple(dict.fromkeys(passes)), share,
                   tuple(dict.fromkeys(o.row.name for o in v.analysis.outliers)), sources)


# The Ascend advisor's affinity patterns (§4.2) over torch's top-level operator names:
# (rule, title, pattern, pass, what it is).
_AFFINITY = (
    ("unfused_gelu", "Unfused GELU", r"pow (?:mul |add ){1,4}tanh add mul", "fuse_gelu",
     "tanh-approximate GELU spelled out (0.5 x (1 + tanh(c (x + 0.044715 x^3))))"),
    ("unfused_rms_norm", "Unfused RMSNorm", r"(?:pow )?(?:mean )?(?:add )?rsqrt mul", "fuse_rms_norm",
     "RMSNorm spelled out (pow, mean, add, rsqrt, mul)"),
    ("unfused_swiglu", "Unfused SwiGLU", r"silu (?:\S+ ){0,2}?mul", "fuse_swiglu",
     "SwiGLU spelled out (silu(gate) * up)"),
    ("unfused_rotary_embedding", "Unfused rotary embedding", r"neg cat (?:mul ){0,2}add",
     "fuse_rotary_embedding", "rotary embedding spelled out (rotate_half: neg, cat; then mul, add)"),
    ("unfused_linear", "Unfused linear", r"(?:t|numpy_T) matmul add", "fuse_linear",
     "matmul(x, w.t()) + b instead of one linear (addmm)"),
)


def _affinity(v: _View, s: AdvisorSettings) -> list[Finding]:
    found = []
    for rule, title, pattern, pass_name, what in _AFFINITY:
        n = _count(pattern, v.sequence) / max(v.steps, 1)
        if n:
            found.append(Finding(rule, title, f"{n:g} site(s) per step: {what}; one fused operator "
                                 "does the same with fewer launches and memory passes.", (pass_name,)))
    return found


_RULES: tuple[Callable[[_View, AdvisorSettings], Finding | None], ...] = (
    _ai_cpu, _unfused_attention, _attention_math_fallback, _non_contiguous, _optimizer_step,
    _matmul_alignment, _transposed_matmul, _shape_outliers, _tiny_operators, _page_faults)


def advise(profile: ProfileLike | Sequence[OpRow], *, device: str | None = None,
           settings: AdvisorSettings = AdvisorSettings()) -> list[Finding]:
    """Findings for a profile, largest share of the step first.

    ``profile`` is a ProfileResult (all rules) or a list of OpRow (the table rules only);
    ``device`` overrides the profile's for device-specific rules (alignment).

        advise(result)                               # [Finding('unfused_attention', ...), ...]
    """
    v = _view(profile, device)
    findings = [f for rule in _RULES if (f := rule(v, settings)) is not None] + _affinity(v, settings)
    return sorted(findings, key=lambda f: f.share, reverse=True)


def findings_to_markdown(findings: Sequence[Finding]) -> str:
    """The findings as a Markdown section."""
    if not findings:
        return "### Advisor\n\nNo known hot spot found.\n"
    lines = ["### Advisor", ""]
    for f in findings:
        share = f" ({100 * f.share:.1f}% of the step)" if f.share else ""
        passes = ", ".join(f"`{p}`" for p in f.passes) or (
            f"none: {f.outside}" if f.outside else "none in this project yet")
        lines.append(f"- **{f.title}**{share}: {f.detail} Pass: {passes}.")
    return "\n".join(lines) + "\n"
