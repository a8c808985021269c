"""Measuring leaves the user's parameters, buffers, optimizer state and RNG bit-identical."""
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rewriter
from tests.controlled import QUICK, ControlledClock, RewriteRelu
from tests.models import BnNet


def _state(model, opt):
    torch_rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    return {
        "params": {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        "grads": {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()},
        "opt": {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                for p, st in opt.state.items()},
        "rng": (torch_rng, py_rng, np_rng[1].copy()),
        "training": [m.training for m in model.modules()],
    }


def _assert_identical(a, b):
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    for k in a["grads"]:
        assert (a["grads"][k] is None) == (b["grads"][k] is None), k
        if a["grads"][k] is not None:
            assert torch.equal(a["grads"][k], b["grads"][k]), k
    assert a["opt"].keys() == b["opt"].keys()
    for pid in a["opt"]:
        for k, v in a["opt"][pid].items():
            assert torch.equal(v, b["opt"][pid][k]) if torch.is_tensor(v) else v == b["opt"][pid][k]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]
    assert np.array_equal(a["rng"][2], b["rng"][2])
    assert a["training"] == b["training"]


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
    before = _state(model, opt)
    rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                      passes=[RewriteRelu("a")], clock=ControlledClock({"a": 0.5}), gate=QUICK,
                      progress=False)
    _assert_identical(before, _state(model, opt))
    assert model.bn.num_batches_tracked.item() == 2


def test_interrupt_while_measuring_leaves_the_model_as_it_was(job):
    model, opt, x, y = job
    before = _state(model, opt)
    with pytest.raises(KeyboardInterrupt):
        rewriter.optimize(model, (x,), optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                          passes=[RewriteRelu("a")], clock=ControlledClock({"a": 0.5}, interrupt_after=3),
                          gate=QUICK, progress=False)
    _assert_identical(before, _state(model, opt))
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
