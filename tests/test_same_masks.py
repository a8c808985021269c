"""A compiled training step that draws dropout is verified with dropout on, against the eager
model drawing the same masks (Inductor's fallback_random, rewriter.decide.same_masks), not in a
second compile with dropout off; its repeated blocks then nest. Real Inductor compiles (CPU),
controlled clocks for the timing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import rewriter
from rewriter.decide import compile_gate, same_masks
from tests.controlled import QUICK, Bf16Cpu, ControlledClock
from tests.test_nested_blocks import DropHeaded


@pytest.fixture
def no_dropout_off_compile(monkeypatch):
    """The compile with dropout off (the old verification) must not happen."""
    def refuse():
        raise AssertionError("verified in a compile with dropout off")
    monkeypatch.setattr(same_masks, "dropout_disabled", refuse)


def _compile_rows(fast):
    return [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]


def test_a_compiled_step_with_dropout_is_verified_with_the_same_masks_and_compiled_once(no_dropout_off_compile,
                                                                                      monkeypatch):
    """...and its knowledge-base key names that form (Inductor's random numbers are another one)."""
    keys = []
    monkeypatch.setattr(compile_gate, "entry_key", lambda text, versions: keys.append(text) or text)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, _ = rewriter.optimize(model, (torch.randn(8, 16),), optimizer=opt, loss_fn=lambda out: out.sum(),
                                clock=ControlledClock({"compile": 0.5}), gate=QUICK, profile=False,
                                progress=False, knowledge_base=False, compile=True, passes=[])
    (d,) = _compile_rows(fast)
    assert d.kept and "the same masks" in d.verification, d.verification
    assert keys and all("(same masks)" in k.split("|")[1] for k in keys), keys


def test_bf16_blocks_with_dropout_nest_and_are_verified_with_the_same_masks(monkeypatch, no_dropout_off_compile):
    """The bf16 training form, the original model under autocast, decided first: its blocks are
    nested (a dropout-off compile kept a reused region's dropout, so they were not before)."""
    monkeypatch.setattr("rewriter.decide.compile_gate.predict_compile_seconds", lambda *a, **k: 1e-3)
    torch.manual_seed(0)
    model, x = DropHeaded().train(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, _ = rewriter.optimize(
        model, (x,), optimizer=opt, loss_fn=lambda out: out.float().pow(2).mean(),
        clock=ControlledClock({"cast_to_half": 0.8, "compile": 0.7, "original": 0.5}), gate=QUICK,
        profile=False, progress=False, knowledge_base=False, compile="auto", steps=100_000,
        dtype=torch.bfloat16, device=Bf16Cpu(), regional=True, passes=["cast_to_half"])
    try:
        (d,) = _compile_rows(fast)
        assert d.kept and "(original model, blocks nested, autocast bfloat16)" in d.sites[0], d.reason
        assert "the same masks" in d.verification, d.verification
    finally:
        fast.restore()


def test_a_miscompiled_step_with_dropout_fails_the_same_masks_check_and_is_not_kept():
    """A compiler whose graphs compute wrong values (every output shifted: a stand-in miscompile),
    posing as Inductor so the same masks are drawn and checked: caught with dropout on, then in
    the compile with dropout off; not kept."""
    from tests.test_nested_blocks import RecordingInductor, _bf16_training

    class Miscompiles(RecordingInductor):
        def __call__(self, gm, example_inputs, config_patches=None):
            compiled = super().__call__(gm, example_inputs, config_patches)
            return lambda *args: [t + 1.0 if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                                  for t in compiled(*args)]

    rec = Miscompiles()
    _, _, fast = _bf16_training(rec, model_class=DropHeaded)
    try:
        (d,) = _compile_rows(fast)
        assert not d.kept and d.status == "failed verification", d.reason
        assert {"fallback_random": True} in [{k: v for k, v in (p or {}).items() if k == "fallback_random"}
                                             for p in rec.patches]
        assert fast.__dict__["_compiled"] is None
    finally:
        fast.restore()
