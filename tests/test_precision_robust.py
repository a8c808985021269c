"""A model that cannot run as captured in the half dtype does not stop optimize(): cast_to_half
saturates fp32's ``finfo.min`` fill (DeBERTa-v2's masked scores raised in bf16), the other passes
are decided without a precision the model cannot run in, and a pass whose decision raises is
rolled back and reported, the run going on."""
import copy

import pytest
import torch
import torch.nn as nn

import rewriter
from rewriter import pipeline
from rewriter.devices import amp
from tests.controlled import QUICK, Bf16Cpu, ControlledClock
from tests.models import HandAttention

BF16 = {"rtol": 1.6e-2, "atol": 2e-2}  # bf16 GEMMs over 32-long rows, softmax in fp32


class MaskedScores(nn.Module):
    """Written-out attention, then scores masked with ``torch.finfo(s.dtype).min`` as DeBERTa-v2
    writes it: a graph captured in fp32 holds fp32's value, which bf16 cannot hold."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.attn = HandAttention("mul", d=d)
        self.q, self.k, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 10)

    def forward(self, x, mask):
        h = x + self.attn(x).transpose(1, 2).reshape(x.shape)
        s = self.q(h) @ self.k(h).transpose(1, 2)
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        return self.head(s.softmax(-1) @ h).mean(1)


def _case():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32)
    mask = (torch.rand(4, 16, 16) > 0.3) | torch.eye(16, dtype=torch.bool)
    return MaskedScores().eval(), (x, mask)


def _optimize(model, inputs, passes, **kw):
    return rewriter.optimize(model, inputs, passes=passes, gate=QUICK, clock=ControlledClock({"cast_to_half": 0.5}),
                             device=Bf16Cpu(), progress=False, profile=False, knowledge_base=False, **kw)


def test_the_fill_saturates_to_the_dtype_it_runs_in():
    mask = torch.tensor([True, False, True])
    low = torch.finfo(torch.float32).min
    half = amp.masked_fill_saturated(torch.zeros(3, dtype=torch.bfloat16), mask, low)
    assert half[0].item() == torch.finfo(torch.bfloat16).min and half[1].item() == 0
    assert amp.masked_fill_saturated(torch.zeros(3), mask, low)[0].item() == low  # fp32: as written
    with pytest.raises(RuntimeError, match="overflow"):  # what the graph did before
        torch.zeros(3, dtype=torch.bfloat16).masked_fill(mask, low)


def test_cast_to_half_keeps_a_model_whose_fp32_min_fill_raised_in_bf16():
    model, inputs = _case()
    fast = _optimize(model, inputs, ["cast_to_half"], dtype=torch.bfloat16)
    d = fast.report.decisions[0]
    assert d.kept, d.reason
    assert any("saturated" in s for s in d.sites)
    assert "masked_fill_saturated" in "".join(fast.graph_code().values())
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs).float(), model(*inputs), **BF16)


def test_the_others_are_decided_without_a_precision_the_model_cannot_run_in(monkeypatch):
    monkeypatch.setattr(amp, "SATURATED_FILLS", {}, raising=False)  # the fill raises in bf16, as before the fix
    model, inputs = _case()
    with torch.no_grad():
        want = model(*inputs)
    fast = _optimize(model, inputs, ["cast_to_half", "fuse_attention"], dtype=torch.bfloat16)
    rows = {d.pass_name: d for d in fast.report.decisions}
    half = rows["cast_to_half"]
    assert not half.kept and half.status == "failed verification" and "raised" in half.reason, half.reason
    assert rows["fuse_attention"].status in ("kept", "rejected"), rows["fuse_attention"].reason
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), want)  # fp32 throughout: fp32 tolerances


def test_a_pass_whose_decision_raises_is_rolled_back_and_the_run_goes_on(monkeypatch):
    def boom(self, p, regions, descriptions):
        raise RuntimeError("boom while measuring")
    monkeypatch.setattr(pipeline.Run, "_try_on_regions", boom)
    model, inputs = _case()
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        want = model(*inputs)
    fast = _optimize(model, inputs, ["fuse_attention"])
    d = fast.report.decisions[0]
    assert d.status == "raised" and not d.kept and "boom while measuring" in d.reason
    assert fast.report.kept_passes == []
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), want)
