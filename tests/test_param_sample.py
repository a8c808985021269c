"""The fused optimizer is decided on one instance of each distinct block and the rest."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewriter
from rewriter.decide.optimizer_gate import step_saved_ms
from rewriter.decide.param_sample import sample_parameters
from rewriter.devices import optimizers
from tests.controlled import QUICK, ControlledClock


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Deep(nn.Module):
    def __init__(self, depth: int = 8, d: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _numel(params):
    return sum(p.numel() for p in params)


def test_one_instance_of_a_repeated_block_and_everything_outside():
    model = Deep(depth=8)
    opt = torch.optim.AdamW(model.parameters())
    s = sample_parameters(opt, model)
    want = [*model.emb.parameters(), *model.layers[0].parameters(), *model.head.parameters()]
    assert s.ids == frozenset(id(p) for p in want)
    assert s.numel == _numel(want) and s.total_numel == _numel(model.parameters())
    assert s.scale == pytest.approx(s.total_numel / s.numel) and s.scale > 2
    assert "1 of 8 Block" in s.description


def test_instances_with_other_shapes_are_kept_one_of_each():
    model = Deep(depth=2)
    model.layers = nn.ModuleList([Block(16) for _ in range(4)] + [Block(32) for _ in range(4)])
    s = sample_parameters(torch.optim.SGD(model.parameters(), lr=0.1), model)
    assert {id(p) for p in model.layers[4].parameters()} <= s.ids
    assert {id(p) for p in model.layers[0].parameters()} <= s.ids
    assert not {id(p) for p in model.layers[5].parameters()} & s.ids
    assert "2 of 8 Block" in s.description


def test_a_sample_over_half_the_parameters_is_not_taken():
    model = Deep(depth=2, vocab=4000)  # the embedding and head outweigh the blocks
    s = sample_parameters(torch.optim.AdamW(model.parameters()), model)
    assert s.ids is None and s.scale == 1.0
    assert sample_parameters(torch.optim.AdamW(model.parameters()), None).ids is None


def test_a_parameter_tied_across_instances_and_one_the_model_does_not_hold_are_kept():
    model = Deep(depth=8)
    for layer in model.layers[1:]:
        layer.down.bias = model.layers[0].down.bias  # one tensor in every instance
    extra = nn.Parameter(torch.zeros(3))
    s = sample_parameters(torch.optim.AdamW([*model.parameters(), extra]), model)
    assert id(model.layers[0].down.bias) in s.ids and id(extra) in s.ids
    assert id(model.layers[3].up.weight) not in s.ids


def test_frozen_layers_are_not_taken_for_the_trained_ones_and_each_group_is_kept():
    """Fine-tuning the last layers: the first instance is frozen (the optimizer holds none of its
    parameters), so the sample takes a trained one; per-layer groups (layer-wise learning rates)
    are layouts of their own."""
    model = Deep(depth=8)
    for layer in model.layers[:4]:
        layer.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    s = sample_parameters(torch.optim.AdamW(trained), model)
    assert {id(p) for p in model.layers[4].parameters()} <= s.ids
    assert not {id(p) for p in model.layers[5].parameters()} & s.ids
    assert s.numel == _numel([*model.emb.parameters(), *model.layers[4].parameters(), *model.head.parameters()])
    assert s.scale == pytest.approx(_numel(trained) / s.numel)
    per_layer = [{"params": layer.parameters(), "lr": 1e-3 * 0.9 ** i} for i, layer in enumerate(model.layers)]
    s = sample_parameters(torch.optim.AdamW(per_layer), model)
    assert s.ids is None  # eight groups: eight layouts, nothing to leave out


def test_scratch_copies_are_of_the_sample_only_and_drop_groups_left_empty():
    model = Deep(depth=8)
    opt = torch.optim.AdamW([{"params": model.layers[4:].parameters(), "lr": 1e-3},
                             {"params": [*model.emb.parameters(), *model.layers[:4].parameters()]}])
    want = [*model.emb.parameters(), *model.layers[0].parameters()]
    scratch, clones = optimizers.scratch_optimizer(opt, None, only={id(p) for p in want})
    # the first group has nothing left: dropped; the other keeps its own settings
    assert len(scratch.param_groups) == 1 and scratch.param_groups[0]["lr"] == opt.param_groups[1]["lr"]
    assert len(clones) == len(want) == 5
    for c, p in zip(clones, want):
        assert c is not p and torch.equal(c, p)


def test_the_decision_is_timed_on_the_sample_and_its_saving_scaled_to_the_step(monkeypatch):
    torch.manual_seed(0)
    model = Deep(depth=8).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    copied: list[int] = []
    real_copy = optimizers.scratch_copy

    def spy(optimizer, seed=0, only=None, max_numel=None):
        groups, state, clones = real_copy(optimizer, seed, only, max_numel)
        copied.append(_numel(clones))
        return groups, state, clones
    monkeypatch.setattr(optimizers, "scratch_copy", spy)
    ids = torch.randint(0, 32, (4, 8))
    target = torch.randn(4, 8, 32)
    fast, opt2 = rewriter.optimize(model, (ids,), optimizer=opt, passes=[],
                                   loss_fn=lambda out: F.mse_loss(out, target),
                                   clock=ControlledClock({"fuse_optimizer": 0.25}), gate=QUICK,
                                   progress=False, profile=False)
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_optimizer")
    s = sample_parameters(opt, model)
    assert d.kept and "timed on 1 of 8 Block" in d.reason
    assert copied and set(copied) == {s.numel}  # numerics and timing: the sample, never all
    m = d.measurement
    assert m["sample"]["scale"] == pytest.approx(s.scale, rel=1e-3)
    assert step_saved_ms(m) == pytest.approx((m["baseline_ms"] - m["candidate_ms"]) * s.scale, rel=1e-3)
    assert step_saved_ms({**m, "sample": None}) == pytest.approx(m["baseline_ms"] - m["candidate_ms"])
