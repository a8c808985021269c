"""Measuring leaves the user's parameters, buffers, optimizer state and RNG bit-identical."""

import pytest
import torch
import torch.nn.functional as F

import rewriter
from tests.controlled import QUICK, ControlledClock, RewriteRelu
from tests.helpers import assert_same_state, state_snapshot
from tests.models import BnNet


@pytest.fixture
def job():
    torch.manual_seed(0)
    model = BnNet().train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    # Real optimizer state and a live gradient, as mid-training.
    F.cross_entropy(model(x), y).backward()
    opt.step()
    F.cross_entropy(model(x), y).backward()
    return model, opt, x, y


def test_measuring_leaves_everything_bit_identical(job):
    model, opt, x, y = job
    before = state_snapshot(model, opt)
    rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                      passes=[RewriteRelu("a")], clock=ControlledClock({"a": 0.5}), gate=QUICK,
                      progress=False)
    assert_same_state(before, state_snapshot(model, opt))
    assert model.bn.num_batches_tracked.item() == 2


def test_interrupt_while_measuring_leaves_the_model_as_it_was(job):
    model, opt, x, y = job
    before = state_snapshot(model, opt)
    with pytest.raises(KeyboardInterrupt):
        rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                          passes=[RewriteRelu("a")], clock=ControlledClock({"a": 0.5}, interrupt_after=3),
                          gate=QUICK, progress=False)
    assert_same_state(before, state_snapshot(model, opt))
    F.cross_entropy(model(x), y).backward()  # still usable
    opt.step()


def test_frozen_parameters_stay_frozen(job):
    model, opt, x, y = job
    model.conv.weight.requires_grad_(False)
    fast, _ = rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda o: F.cross_entropy(o, y),
                                passes=[RewriteRelu("a")], clock=ControlledClock({"a": 0.5}),
                                gate=QUICK, progress=False)
    assert not model.conv.weight.requires_grad
    model.zero_grad(set_to_none=True)
    F.cross_entropy(fast(x), y).backward()
    assert model.conv.weight.grad is None and model.head.weight.grad is not None
