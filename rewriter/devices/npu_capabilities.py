"""What an Ascend chip and a torch_npu release can run: the facts ``NpuBackend`` gates on.

Nothing here imports torch_npu: ``NpuBackend`` reads the chip model
(``torch.npu.get_device_name()``), the package version and ``torch.npu.is_bf16_supported()``
and hands them to :class:`NpuCapabilities`, which answers "can this op run here, and if not,
which condition fails". Every fact cites ``../shared/reference/npu_ecosystem.md`` (§ numbers)
or the torch_npu/op-plugin file it comes from.

Chips (``get_device_name()`` returns the SoC name, e.g. ``Ascend910B2``; names from
``torch_npu/csrc/core/npu/NpuVariables.cpp``; torch_npu itself tells A2 from A3 by comparing
these strings, reference §2.3):

=============  ==========================================  =================================
family         SoC names                                    products
=============  ==========================================  =================================
``A2``         Ascend910B1..B4, B2C, B4-1                   Atlas A2 training / 800I A2
``A3``         Ascend910_93xx                               Atlas A3 training / inference
``training``   Ascend910A, 910ProA, 910ProB, 910PremiumA,   Atlas training (910)
               910B (no digit)
``inference``  Ascend310P1..P7                              Atlas inference (300I/310P)
``950``        Ascend950*, Ascend910_95*                    Ascend 950DT
=============  ==========================================  =================================

The minimum torch_npu: **2.4.0.post2** (TorchNPU 6.0.0, CANN 8.0.0). It is the oldest
torch_npu for the oldest torch this project installs with (``torch>=2.4``), the oldest branch
the reference's audit checked (op-plugin 6.0.0 onwards, §0), and every op rewriter emits exists
there: npu_fusion_attention from TorchNPU 5.0.rc3, npu_rms_norm 5.0.0, npu_swiglu and
npu_geglu's ``activate_left`` 6.0.rc1, npu_gelu 6.0.0. One minimum therefore gates them all;
torch_npu 2.4.0 (TorchNPU 6.0.rc3, no npu_gelu) is declined as a whole.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

A2, A3, TRAINING, INFERENCE, ASCEND950, OTHER = "A2", "A3", "training", "inference", "950", "other"

FAMILY_NAMES = {A2: "Atlas A2", A3: "Atlas A3", TRAINING: "Atlas training (910)",
                INFERENCE: "Atlas inference (310P)", ASCEND950: "Ascend 950", OTHER: "an unlisted chip"}

_TRAINING_910 = frozenset({"Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B"})


def chip_family(soc: str) -> str:
    """The product family of a SoC name as ``torch.npu.get_device_name()`` returns it."""
    if soc in _TRAINING_910:
        return TRAINING
    if soc.startswith("Ascend910B"):
        return A2
    if soc.startswith(("Ascend910_95", "Ascend950")):  # torchair's is_arch35() test
        return ASCEND950
    if soc.startswith("Ascend910_93"):
        return A3
    if soc.startswith("Ascend310P"):
        return INFERENCE
    return OTHER


# torch_npu package version -> TorchNPU release (the ``v{torch}-{release}`` branch names of
# Ascend/pytorch COMPATIBILITY.en.md; reference §8). Only for torch >= 2.4, the project's floor;
# 2.10.0.post2 is the README's CANN 9.0.0 example (26.0.0).
TORCH_NPU_RELEASES = {
    "2.4.0": "6.0.rc3", "2.4.0.post2": "6.0.0", "2.4.0.post4": "7.0.0",
    "2.5.1": "7.0.0", "2.5.1.post1": "7.1.0",
    "2.6.0": "7.1.0", "2.6.0.post3": "7.2.0", "2.6.0.post5": "7.3.0",
    "2.7.1": "7.2.0", "2.7.1.post2": "7.3.0", "2.7.1.post4": "26.0.0", "2.7.1.post8": "26.1.0",
    "2.8.0": "7.2.0", "2.8.0.post2": "7.3.0", "2.8.0.post4": "26.0.0",
    "2.9.0": "7.3.0", "2.9.0.post2": "26.0.0", "2.9.0.post6": "26.1.0",
    "2.10.0.post2": "26.0.0", "2.10.0.post4": "26.1.0", "2.11.0": "26.1.0", "2.12.0": "26.1.0",
}
MIN_TORCH_NPU = "2.4.0.post2"

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?")


def parse_torch_npu_version(version: str) -> tuple[tuple[int, int, int], int] | None:
    """((major, minor, patch), post) of a torch_npu version string, or None if unreadable."""
    m = _VERSION.match(version or "")
    if m is None:
        return None
    return (int(m[1]), int(m[2]), int(m[3])), int(m[4] or 0)


def torch_npu_release(version: str) -> str | None:
    """The TorchNPU release of a package version: exact, else the newest listed release of the
    same torch with a lower ``.postN`` (a later post is at least that), else None."""
    if version in TORCH_NPU_RELEASES:
        return TORCH_NPU_RELEASES[version]
    parsed = parse_torch_npu_version(version)
    if parsed is None:
        return None
    same = [(p[1], r) for v, r in TORCH_NPU_RELEASES.items()
            if (p := parse_torch_npu_version(v)) and p[0] == parsed[0] and p[1] <= parsed[1]]
    return max(same)[1] if same else None


def version_problem(version: str) -> str | None:
    """None when ``version`` is at least :data:`MIN_TORCH_NPU`, else why not."""
    parsed, floor = parse_torch_npu_version(version), parse_torch_npu_version(MIN_TORCH_NPU)
    if parsed is None:
        return f"torch_npu version {version!r} is unreadable; rewriter needs >= {MIN_TORCH_NPU}"
    if parsed < floor:  # type: ignore[operator]
        release = torch_npu_release(version)
        named = f" (TorchNPU {release})" if release else ""
        return (f"torch_npu {version}{named} is older than {MIN_TORCH_NPU} (TorchNPU 6.0.0), the oldest "
                f"rewriter supports (npu_gelu arrived in 6.0.0)")
    return None


@dataclass(frozen=True)
class OpSupport:
    """One torch_npu op: the chip families its docs list, and where bf16 is listed."""

    op: str
    families: frozenset[str]
    bf16_families: frozenset[str]
    source: str  # where the facts come from
    dtypes: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})


_ALL_FOUR = frozenset({A2, A3, TRAINING, INFERENCE})
_A2_A3 = frozenset({A2, A3})

# kind (what passes ask the backend for) -> the op that serves it.
OPS: dict[str, OpSupport] = {
    # Products: Atlas A2 training and Ascend 950DT (§1.1). A3 is not in those docs, but
    # torch_npu's own SDPA routes to this kernel on every SoC >= Ascend910B1 (§1.1), A3 included.
    "attention": OpSupport("npu_fusion_attention", frozenset({A2, A3, ASCEND950}),
                           frozenset({A2, A3, ASCEND950}), "§1.1"),
    # Dtype pairs are listed for A2/A3 and for Atlas training/inference; bf16 only on A2/A3 (§1.3).
    "rms_norm": OpSupport("npu_rms_norm", _ALL_FOUR, _A2_A3, "§1.3"),
    # Product table of torch_npu-npu_gelu.md: Atlas inference, A2, Atlas training; bf16 on A2 only.
    "gelu_tanh": OpSupport("npu_gelu", frozenset({A2, TRAINING, INFERENCE}), frozenset({A2}),
                           "§1.8, op-plugin torch_npu-npu_gelu.md"),
    # fp16/fp32, +bf16 on A2/A3; formulas given for A2/A3 and for Atlas training/310P (§1.8).
    "quick_gelu": OpSupport("npu_fast_gelu", _ALL_FOUR, _A2_A3, "§1.8"),
    # Doc products: Atlas A2 training only (§1.6).
    "swiglu": OpSupport("npu_swiglu", frozenset({A2}), frozenset({A2}), "§1.6"),
    # No bf16 on Atlas training/310P (issue 18's audit of GeGluV3; §1.7 has no product table).
    "geglu": OpSupport("npu_geglu", _ALL_FOUR, _A2_A3, "§1.7"),
    # Product table of torch_npu-npu_rotary_mul.md: A3, A2, Atlas training, Atlas inference.
    "rotary": OpSupport("npu_rotary_mul", _ALL_FOUR, _A2_A3, "§1.5, op-plugin torch_npu-npu_rotary_mul.md"),
    # fp16/fp32/integers, no bf16 listed (§1.10).
    "confusion_transpose": OpSupport("npu_confusion_transpose", _ALL_FOUR, frozenset(), "§1.10",
                                     frozenset({torch.float16, torch.float32, torch.int8, torch.int16,
                                                torch.int32, torch.int64, torch.uint8})),
    # The decode step's attention (rewriter.devices.npu_decode_attention): FIA, inference only,
    # fp16/bf16 (§1.2); products Atlas A2 training / 800I A2 and A3 (torchair's FIA page, 7.1.0).
    "decode_attention": OpSupport("npu_fused_infer_attention_score", _A2_A3, _A2_A3,
                                  "§1.2, torchair npu_fused_infer_attention_score",
                                  frozenset({torch.float16, torch.bfloat16})),
    # torch_npu.optim: products Atlas training, A2, A3, not 310P; fp32/fp16 params only (§2.1).
    "fused_optimizer": OpSupport("torch_npu.optim.NpuFused*", frozenset({A2, A3, TRAINING}), frozenset(), "§2.1"),
}

# npu_rms_norm (x, gamma) dtype pairs (§1.3).
_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
RMS_NORM_PAIRS = {
    A2: {(_F16, _F32), (_BF16, _F32), (_F16, _F16), (_BF16, _BF16), (_F32, _F32)},
    A3: {(_F16, _F32), (_BF16, _F32), (_F16, _F16), (_BF16, _BF16), (_F32, _F32)},
    TRAINING: {(_F16, _F16), (_F32, _F32)},
    INFERENCE: {(_F16, _F16), (_F32, _F32)},
}

# Chips whose torch_npu default is jit_compile=True (online compiling): Atlas training and 310P
# (§6). npu_rotary_mul there: 'half' only, 4-D, B and N <= 1000, D == 128 (§1.5).
JIT_COMPILE_FAMILIES = frozenset({TRAINING, INFERENCE})

# npu_fusion_attention shape limits (§1.1).
FA_MAX_HEADS = 256
FA_MAX_HEAD_DIM = 768


@dataclass(frozen=True)
class NpuCapabilities:
    """The chip and torch_npu release a backend runs on, and what they allow."""

    chip: str
    version: str
    bf16: bool  # torch.npu.is_bf16_supported()

    @property
    def family(self) -> str:
        return chip_family(self.chip)

    def where(self) -> str:
        return f"{self.chip} ({FAMILY_NAMES[self.family]}), torch_npu {self.version}"

    def cannot_run(self, kind: str, dtype: torch.dtype | None = None) -> str | None:
        """None when the op serving ``kind`` runs here (in ``dtype``, if given), else why not."""
        support = OPS.get(kind)
        if support is None:
            return None  # stock torch on the NPU (layer_norm, SDPA): nothing torch_npu-specific
        problem = version_problem(self.version)
        if problem:
            return problem
        if self.family not in support.families:
            listed = ", ".join(FAMILY_NAMES[f] for f in sorted(support.families))
            return f"{support.op} is documented for {listed}, not {self.where()} ({support.source})"
        if dtype is not None:
            return self.cannot_take(kind, dtype)
        return None

    def cannot_take(self, kind: str, dtype: torch.dtype) -> str | None:
        """None when the op serving ``kind`` takes ``dtype`` here, else why not."""
        support = OPS[kind]
        if dtype not in support.dtypes:
            return f"{support.op} does not take {dtype} ({support.source})"
        if dtype == torch.bfloat16:
            if not self.bf16:
                return f"torch.npu.is_bf16_supported() is False on {self.where()}"
            if self.family not in support.bf16_families:
                return f"{support.op} takes no bfloat16 on {FAMILY_NAMES[self.family]} ({support.source})"
        return None

    @property
    def amp_dtypes(self) -> tuple[torch.dtype, ...]:
        """Autocast dtypes: bf16 only where torch.npu.is_bf16_supported() (§2.4)."""
        return (torch.float16, torch.bfloat16) if self.bf16 else (torch.float16,)
