"""Issue 9: bad input, faults and state safety — the guarantees no other test file covers.

Users hand optimize() their training job; it must never cost them a run or a checkpoint. Each
test names the guarantee it checks. Decisions come from the controlled clock (no timings);
``RewriteRelu("a")`` is the stand-in rewrite the clock makes twice as fast, so "kept" means the
wrapper really runs the captured graph. Where a guarantee is already tested elsewhere, that
file is named in the README's table, not repeated here.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import pathlib
import pickle
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule

import rewriter
from rewriter import Pass, PassContext, Site
from rewriter.capture.ir import mark_new_node
from rewriter.decide.verify import flatten_output
from rewriter.errors import PlanError
from tests.controlled import QUICK, ControlledClock, RewriteRelu
from tests.helpers import assert_same_state, state_snapshot
from tests.models import BnNet, HandAttention, ReluMLP

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = {"a": 0.5, "b": 0.5, "fuse_attention": 0.5}


def _opt(model, inputs, **kw):
    kw.setdefault("clock", ControlledClock(FAST))
    kw.setdefault("passes", [RewriteRelu("a")])
    kw.setdefault("compile", False)  # the passes' decisions only (the compile row: test_compile_gate)
    return rewriter.optimize(model, inputs, gate=QUICK, progress=False, profile=False, **kw)


def _outputs_and_grads(fn, args, params, kwargs=None):
    """Outputs of one call and the parameters' gradients through a fixed cotangent on the
    floating-point outputs (integer and boolean outputs are compared, not differentiated)."""
    for p in params:
        p.grad = None
    out = [t for _, t in flatten_output(fn(*args, **(kwargs or {})))]
    gen = torch.Generator().manual_seed(1)
    sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum()
        for t in out if t.is_floating_point()).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return [t.detach() for t in out], grads


def _assert_same_run(fast, model, args, kwargs=None):
    params = list(model.parameters())
    got = _outputs_and_grads(fast, args, params, kwargs)
    want = _outputs_and_grads(model, args, params, kwargs)
    assert [t.dtype for t in got[0]] == [t.dtype for t in want[0]]
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the stand-in rewrites are exact
    return got


# --- controlled passes -----------------------------------------------------------------------

REWRITTEN_GRAPH_RUNS = [0]


def count_run(x):
    """Placed in a rewritten graph: counts how often that graph really runs."""
    REWRITTEN_GRAPH_RUNS[0] += 1
    return x


class CountingRelu(RewriteRelu):
    """Exact rewrite whose graph counts its own executions (is the kept rewrite what runs?)."""

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        g = gm.graph
        for site in sites[:1]:
            with g.inserting_after(site.anchor):
                new = mark_new_node(g.call_function(count_run, (site.anchor,)), self.name, like=site.anchor)
            site.anchor.replace_all_uses_with(new)
            new.args = (site.anchor,)


class IntroduceNonFinite(Pass):
    """A faster-looking rewrite that breaks numerics. "forward": ``relu(x) * inf`` (inf and
    NaN in the outputs); "gradient": ``r + 0 * sqrt(r - r)`` with ``r = relu(x)``, whose value
    is exactly ``r`` but whose derivative is ``0 * inf``: NaN only in the gradients."""

    contract = "exact"

    def __init__(self, name: str, where: str) -> None:
        self.name, self.where = name, where  # type: ignore[misc]

    def find(self, gm, ctx):
        return [Site(n, n.name) for n in gm.graph.nodes
                if n.op == "call_function" and n.target in (F.relu, torch.relu)]

    def apply(self, gm, sites, ctx):
        g = gm.graph
        for site in sites:
            r = site.anchor
            with g.inserting_before(r.next):
                if self.where == "forward":
                    made = [g.call_function(torch.mul, (r, float("inf")))]
                else:
                    made = [g.call_function(torch.sub, (r, r))]
                    made.append(g.call_function(torch.sqrt, (made[-1],)))
                    made.append(g.call_function(torch.mul, (made[-1], 0.0)))
                    made.append(g.call_function(torch.add, (r, made[-1])))
            for n in made:
                mark_new_node(n, self.name, like=r)
            r.replace_all_uses_with(made[-1], delete_user_cb=lambda user: user not in made)


class InterruptingRelu(RewriteRelu):
    """Ctrl-C arrives while the pass rewrites (inside the pipeline, not the clock)."""

    def apply(self, gm, sites, ctx):
        raise KeyboardInterrupt


# --- small models ----------------------------------------------------------------------------

class UserBug(Exception):
    """An exception type of the user's own: it must reach them as the cause."""


class RaisingForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        raise UserBug(f"forward failed at call {self.calls}")


@dataclasses.dataclass
class PlainOutput:
    logits: torch.Tensor
    extra: tuple


def _hf_output_class():
    transformers = pytest.importorskip("transformers")

    @dataclasses.dataclass
    class TinyModelOutput(transformers.utils.ModelOutput):
        logits: torch.Tensor | None = None
        hidden_states: tuple | None = None
    return TinyModelOutput


class PytreeNet(nn.Module):
    """Returns its outputs in the container ``kind`` names (integer leaves included)."""

    def __init__(self, kind: str, output_class=None) -> None:
        super().__init__()
        self.kind, self.output_class = kind, output_class
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        y = self.fc2(h)
        if self.kind == "model_output":
            return self.output_class(logits=y, hidden_states=(h,))
        if self.kind == "dataclass":
            return PlainOutput(y, (h, {"doubled": y * 2}))
        if self.kind == "nested_tuple":
            return y, (h, [y.argmax(-1), {"h": h, "y": (y + 1,)}])
        return {"logits": y, "aux": (h, y.sum(-1))}


class IdsAndMask(nn.Module):
    """Integer ids, a boolean mask and a Python int: the non-float inputs of real models."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(20, 8), nn.Linear(8, 8)

    def forward(self, ids, keep, scale: int = 1):
        h = F.relu(self.fc(self.emb(ids))) * scale
        h = h.masked_fill(~keep[..., None], 0.0)
        return h, keep.sum(-1), ids.max()


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(12, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(F.relu(self.mid(self.emb(ids))))


class AlreadyNonFinite(nn.Module):
    """Outputs with NaN (log of negatives) and inf (overflow) beside ordinary finite values;
    in training, ``blow``'s gradients are inf/NaN already in the original."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.blow = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        finite = F.relu(self.fc(x))
        return torch.cat([finite, torch.log(x), self.blow(x) * 1e39], dim=-1)


# --- bad input -------------------------------------------------------------------------------

def test_input_on_another_device_is_refused_naming_both_devices():
    model = ReluMLP()
    meta = torch.randn(2, 16, device="meta")
    with pytest.raises(ValueError, match="on meta but the model is on cpu"):
        _opt(model, (meta,))
    lazy = _opt(model, None)
    with pytest.raises(ValueError, match="on meta but the model is on cpu"):
        lazy(meta)  # the lazy path checks at the first call


def test_forward_that_raises_reaches_the_user_as_the_cause():
    model, x = RaisingForward().train(), torch.randn(4, 8)
    before = state_snapshot(model)
    with pytest.raises(ValueError, match="cannot run on the example inputs.*UserBug") as info:
        _opt(model, (x,))
    assert isinstance(info.value.__cause__, UserBug) and "call 1" in str(info.value.__cause__)
    assert_same_state(before, state_snapshot(model))


def test_user_code_that_raises_while_measuring_propagates_and_restores_the_model():
    """The loss function (user code run at every measured step) fails part way through the
    measuring: the user's own exception reaches them and the model is as it was."""
    model, opt, x, y = _mid_training()
    before = state_snapshot(model, opt)
    calls = [0]

    def flaky_loss(out):
        calls[0] += 1
        if calls[0] == 8:  # after the reference, capture and candidate checks: mid-measuring
            raise UserBug("loss failed")
        return F.cross_entropy(out, y)
    clock = ControlledClock(FAST)
    with pytest.raises(UserBug, match="loss failed"):
        _opt(model, (x,), optimizer=opt, loss_fn=flaky_loss, clock=clock)
    assert clock.calls > 0
    assert_same_state(before, state_snapshot(model, opt))
    assert model.bn.num_batches_tracked.item() == 2  # the measured steps' BN updates undone


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("kind", [
    pytest.param("model_output", id="model_output"), "dataclass", "nested_tuple", "dict"])
def test_outputs_of_any_pytree_shape_train_with_the_default_loss(kind, front_end, request):
    torch.manual_seed(0)
    model = PytreeNet(kind, _hf_output_class() if kind == "model_output" else None).train()
    x = torch.randn(3, 8)
    fast = _opt(model, (x,), front_end=front_end)  # no loss_fn: the fixed-cotangent default
    assert fast.report.mode == "training" and fast.report.kept_passes == ["a"]
    got, want = fast(x), model(x)
    assert type(got) is type(want)
    assert [p for p, _ in flatten_output(got)] == [p for p, _ in flatten_output(want)]
    _assert_same_run(fast, model, (x,))


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_integer_and_boolean_inputs_and_outputs(front_end):
    torch.manual_seed(0)
    model = IdsAndMask().train()
    ids, keep = torch.randint(0, 20, (2, 5)), torch.rand(2, 5) > 0.3
    inputs = {"ids": ids, "keep": keep, "scale": 3}
    fast = _opt(model, inputs, front_end=front_end, loss_fn=lambda out: out[0].pow(2).mean())
    assert fast.report.front_end == front_end and fast.report.kept_passes == ["a"]
    assert fast.report.mode == "training"
    for ids2, keep2 in ((ids, keep), (torch.randint(0, 20, (2, 5)), torch.rand(2, 5) > 0.5)):
        outputs, _ = _assert_same_run(fast, model, (ids2,), {"keep": keep2, "scale": 3})
        assert [t.dtype for t in outputs] == [torch.float32, torch.int64, torch.int64]


def test_no_grad_requiring_parameters_gates_the_forward_and_stays_frozen():
    torch.manual_seed(0)
    frozen = ReluMLP().train()
    for p in frozen.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 16)
    before = state_snapshot(frozen)
    fast = _opt(frozen, (x,), loss_fn=lambda out: out.sum())
    assert fast.report.mode == "inference" and fast.report.kept_passes == ["a"]
    assert_same_state(before, state_snapshot(frozen))
    assert not any(p.requires_grad for p in frozen.parameters())
    torch.testing.assert_close(fast(x), frozen(x), rtol=0, atol=0)

    class NoParameters(nn.Module):
        def forward(self, x):
            return F.relu(x) * 2
    bare = _opt(NoParameters().train(), (x,))
    assert bare.report.mode == "inference" and bare.report.kept_passes == ["a"]
    torch.testing.assert_close(bare(x), F.relu(x) * 2)



class CountingForward(ReluMLP):
    """ReluMLP that counts its forward calls: "refused before the model runs" means 0."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_exclude_given_as_one_name_excludes_that_pass():
    fast = _opt(ReluMLP().eval(), (torch.randn(2, 16),), passes=["fuse_linear", "fuse_gelu"],
                exclude="fuse_linear")
    assert [d.pass_name for d in fast.report.decisions] == ["fuse_gelu"]


@pytest.mark.parametrize("option", [{"gate": {"warmup": 1}}, {"clock": 0.01}])
def test_options_of_the_wrong_type_are_refused_before_the_model_runs(option):
    model = CountingForward().eval()
    kw = {"gate": QUICK, "clock": ControlledClock(FAST), **option}
    with pytest.raises(TypeError, match=next(iter(option))):
        rewriter.optimize(model, (torch.randn(2, 16),), passes=[RewriteRelu("a")], progress=False,
                          profile=False, **kw)
    assert model.calls == 0


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_a_device_that_is_not_available_is_refused_before_the_model_runs(device, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = CountingForward().eval()
    with pytest.raises(ValueError, match=device):
        _opt(model, (torch.randn(2, 16),), device=device)
    assert model.calls == 0


# --- faults ----------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["forward", "gradient"])
def test_rewrite_that_introduces_nan_or_inf_is_rejected_and_the_next_pass_still_runs(where):
    torch.manual_seed(0)
    model, x = ReluMLP().train(), torch.randn(8, 16)
    clock = ControlledClock({"non_finite": 0.1, "b": 0.5})  # the broken one "looks" 10x faster
    fast = _opt(model, (x,), passes=[IntroduceNonFinite("non_finite", where), RewriteRelu("b")],
                clock=clock, loss_fn=lambda out: out.pow(2).mean())
    bad, good = fast.report.decisions
    assert bad.status == "failed verification" and bad.speedup is None and not bad.kept
    assert "non-finite values where the original is finite" in bad.reason
    # attributed to the site: the region's output, or the gradient of its input
    assert ("at relu: output 0" if where == "forward" else "at relu: grad input 0") in bad.reason
    assert ("non_finite",) not in clock.seen  # never measured
    assert good.kept and fast.report.kept_passes == ["b"]
    outputs, grads = _assert_same_run(fast, model, (x,))
    assert all(torch.isfinite(t).all() for t in outputs + grads)


def _mid_training(model_cls=BnNet):
    torch.manual_seed(0)
    model = model_cls().train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    F.cross_entropy(model(x), y).backward()  # real optimizer state and a live gradient
    opt.step()
    F.cross_entropy(model(x), y).backward()
    return model, opt, x, y


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_interrupt_while_measuring_leaves_the_model_as_it_was_and_optimizable_again(front_end):
    model, opt, x, y = _mid_training()
    before = state_snapshot(model, opt)
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        _opt(model, (x,), optimizer=opt, loss_fn=loss, front_end=front_end,
             clock=ControlledClock(FAST, interrupt_after=3))
    assert_same_state(before, state_snapshot(model, opt))
    fast, opt2 = _opt(model, (x,), optimizer=opt, loss_fn=loss, front_end=front_end)
    assert fast.report.front_end == front_end and fast.report.kept_passes == ["a"]
    assert_same_state(before, state_snapshot(model, opt))
    loss(fast(x)).backward()
    opt2.step()  # and it trains


def test_interrupt_inside_a_pass_is_not_swallowed_and_leaves_the_model_as_it_was():
    model, opt, x, y = _mid_training()
    before = state_snapshot(model, opt)
    with pytest.raises(KeyboardInterrupt):
        _opt(model, (x,), optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
             passes=[InterruptingRelu("a"), RewriteRelu("b")])
    assert_same_state(before, state_snapshot(model, opt))


class _RunsWhenUnpickled:
    """A pickle that creates ``path`` when loaded: proof that nothing unpickles a plan."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("damage", ["truncated", "kept_passes_not_a_list", "json_list", "pickle"])
def test_damaged_plan_error_names_the_file_before_any_measuring(tmp_path, damage):
    torch.manual_seed(0)
    model, x = HandAttention("mul").eval(), torch.randn(2, 16, 32)
    _opt(model, (x,), passes=["fuse_attention"]).report.save(tmp_path)
    path = tmp_path / "plan.json"
    text = path.read_text()
    marker = tmp_path / "unpickled"
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "kept_passes_not_a_list":
        path.write_text(json.dumps({**json.loads(text), "kept_passes": "fuse_attention"}))
    elif damage == "json_list":
        path.write_text(json.dumps([json.loads(text)]))
    else:
        path.write_bytes(pickle.dumps(_RunsWhenUnpickled(str(marker))))
    clock = ControlledClock(FAST)
    with pytest.raises(PlanError, match=str(path)):
        _opt(model, (x,), passes=["fuse_attention"], plan=str(path), clock=clock)
    assert clock.calls == 0 and not marker.exists()


def test_plan_keeping_an_unknown_pass_names_the_file(tmp_path):
    torch.manual_seed(0)
    model, x = HandAttention("mul").eval(), torch.randn(2, 16, 32)
    _opt(model, (x,), passes=["fuse_attention"]).report.save(tmp_path)
    path = tmp_path / "plan.json"
    plan = json.loads(path.read_text())
    path.write_text(json.dumps({**plan, "kept_passes": ["fuse_everything"]}))
    with pytest.raises(PlanError, match=f"{path}.*fuse_everything|fuse_everything.*{path}"):
        _opt(model, (x,), passes=["fuse_attention"], plan=str(path))


# --- state -----------------------------------------------------------------------------------

@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_tied_weights_stay_tied_through_optimize_and_training(front_end):
    torch.manual_seed(0)
    model, ids = TiedLM().train(), torch.randint(0, 12, (2, 5))
    twin = TiedLM()
    twin.load_state_dict(model.state_dict())
    loss = lambda out: out.logsumexp(-1).mean()  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    fast, opt = _opt(model, (ids,), optimizer=opt, loss_fn=loss, front_end=front_end)
    assert fast.report.kept_passes == ["a"]
    assert fast.head.weight is fast.emb.weight is model.emb.weight
    assert len(list(fast.parameters())) == 3  # one tensor, counted once
    for _ in range(3):
        for m, o in ((fast, opt), (twin, twin_opt)):
            o.zero_grad()
            loss(m(ids)).backward()  # the tied gradient sums both uses
            o.step()
    assert model.head.weight is model.emb.weight
    for (name, p), q in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@contextlib.contextmanager
def _record_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


class HookLog:
    """A pre-hook that doubles the input and a forward hook that records and shifts the output.
    Only stores (no reads of Python state), so Dynamo does not guard on the log."""

    def __init__(self, model: ReluMLP) -> None:
        self.record: dict[str, torch.Tensor] = {}
        model.fc1.register_forward_pre_hook(self.pre)
        model.fc2.register_forward_hook(self.post)

    def pre(self, module, args):
        self.record["fc1 input"] = args[0].detach().clone()
        return (args[0] * 2,)

    def post(self, module, args, output):
        self.record["fc2 output"] = output.detach().clone()
        return output + 1


@pytest.mark.parametrize("front_end", ["auto", "dynamo"])
@pytest.mark.parametrize("training", [False, True])
def test_hooks_on_submodules_run_at_every_call_after_optimize(front_end, training):
    torch.manual_seed(0)
    model = ReluMLP().train(training)
    hooks = HookLog(model)
    REWRITTEN_GRAPH_RUNS[0] = 0
    fast = _opt(model, (torch.randn(4, 16),), front_end=front_end, passes=[CountingRelu("a")],
                loss_fn=(lambda out: out.sum()) if training else None)
    assert fast.report.front_end == "dynamo" and fast.report.kept_passes == ["a"]
    if front_end == "auto":  # symbolic_trace would drop the hooks: declined
        assert "hooks (fc1, fc2)" in fast.report.front_end_reason
    REWRITTEN_GRAPH_RUNS[0] = 0
    for i in range(3):
        x = torch.randn(4, 16)
        got = fast(x)
        assert torch.equal(hooks.record["fc1 input"], x)  # this call's side effects
        recorded = hooks.record["fc2 output"]
        want = model(x)
        assert torch.equal(hooks.record["fc2 output"], recorded)  # eager run recorded the same
        torch.testing.assert_close(got, recorded + 1, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert REWRITTEN_GRAPH_RUNS[0] == 3  # the hooks ran inside the rewritten graph's call


def test_hooks_with_front_end_fx_still_run_or_optimize_warns():
    torch.manual_seed(0)
    model = ReluMLP().eval()
    seen: list[int] = []
    model.fc2.register_forward_hook(lambda module, args, output: seen.append(1))
    with _record_warnings() as warned:
        fast = _opt(model, (torch.randn(4, 16),), front_end="fx")
    seen.clear()
    fast(torch.randn(4, 16))
    assert seen == [1] or any("hook" in str(w.message) for w in warned)


def test_hook_registered_after_optimize_runs_or_optimize_warns():
    torch.manual_seed(0)
    model = ReluMLP().eval()
    fast = _opt(model, (torch.randn(4, 16),))
    assert fast.report.front_end == "fx"
    seen: list[int] = []
    model.fc2.register_forward_hook(lambda module, args, output: seen.append(1))
    with _record_warnings() as warned:
        fast(torch.randn(4, 16))
    assert seen == [1] or any("hook" in str(w.message) for w in warned)


def test_a_hook_that_counts_calls_does_not_silently_disable_the_kept_rewrite():
    torch.manual_seed(0)
    model = ReluMLP().eval()
    counter = {"calls": 0}

    def count(module, args, output):
        counter["calls"] += 1
    model.fc2.register_forward_hook(count)
    fast = _opt(model, (torch.randn(4, 16),), passes=[CountingRelu("a")])
    REWRITTEN_GRAPH_RUNS[0], counter["calls"] = 0, 0
    with torch.no_grad():
        for _ in range(3):
            fast(torch.randn(4, 16))
    assert counter["calls"] == 3
    assert not fast.report.final["kept"] or REWRITTEN_GRAPH_RUNS[0] == 3


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_state_dict_after_training_loads_into_the_original_class(tmp_path, front_end):
    """A checkpoint of the optimized model, saved and loaded the safe way (weights_only=True),
    loads strictly into a fresh instance of the user's class and computes the same."""
    model, opt, x, y = _mid_training()
    fast, opt = _opt(model, (x,), optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                     front_end=front_end)
    assert fast.report.kept_passes == ["a"]
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(fast(x), y).backward()
        opt.step()
    torch.save(fast.state_dict(), tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert list(loaded) == list(BnNet().state_dict())  # original keys, buffers included
    fresh = BnNet()
    fresh.load_state_dict(loaded, strict=True)
    assert fresh.bn.num_batches_tracked.item() == model.bn.num_batches_tracked.item() == 4
    fast.eval(), fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), fresh(x), rtol=0, atol=0)
    fast.load_state_dict(BnNet().state_dict())  # and back into the optimized model
    assert torch.equal(model.conv.weight, fast.conv.weight)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_lazy_first_call_is_the_step_the_model_would_have_taken(front_end):
    """optimize() without inputs decides inside the first call; that call's output, BatchNorm
    update and RNG use are exactly those of calling the model itself."""
    torch.manual_seed(0)
    model, x = BnNet().train(), torch.randn(4, 3, 8, 8)
    twin = BnNet().train()
    twin.load_state_dict(model.state_dict())
    fast = _opt(model, None, front_end=front_end)
    torch.manual_seed(5)
    got = fast(x)
    rng_after_fast = torch.get_rng_state()
    torch.manual_seed(5)
    want = twin(x)
    assert fast.report.kept_passes == ["a"]
    assert torch.equal(got, want) and torch.equal(rng_after_fast, torch.get_rng_state())
    for k, v in twin.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


# --- numerics --------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [False, True])
def test_model_already_producing_nan_and_inf_is_compared_where_the_original_is_finite(training):
    torch.manual_seed(0)
    model, x = AlreadyNonFinite().train(training), torch.randn(6, 4)
    want = model(x)
    assert torch.isnan(want).any() and torch.isinf(want).any() and torch.isfinite(want).any()
    fast = _opt(model, (x,), passes=[RewriteRelu("a"), RewriteRelu("off", shift=1e-2)],
                clock=ControlledClock({"a": 0.5, "off": 0.5}))
    exact, off = fast.report.decisions
    assert exact.kept and exact.max_abs_error == 0.0  # NaN == NaN positions are not "errors"
    assert off.status == "failed verification" and "elements off" in off.reason  # finite part
    got = fast(x)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[finite], want[finite])


def test_dropout_model_is_verified_deterministically():
    """Dropout 0.5 in training: the fused kernel draws its own mask, so only a check with
    dropout off can pass; it passes, identically on every run, and dropout stays on."""
    errors = []
    for _ in range(2):
        torch.manual_seed(0)
        model, x = HandAttention("mul", dropout=0.5).train(), torch.randn(2, 16, 32)
        rng = torch.get_rng_state()
        fast = _opt(model, (x,), passes=["fuse_attention"], loss_fn=lambda out: out.pow(2).mean())
        d = fast.report.decisions[0]
        assert d.kept and "dropout 0.5" in d.sites[0]
        assert torch.equal(rng, torch.get_rng_state())
        errors.append(d.max_abs_error)
    assert errors[0] == errors[1] and errors[0] < 1e-5
    torch.manual_seed(1)
    first, second = fast(x), fast(x)
    assert not torch.equal(first, second)  # dropout still drops, at every call
    fast.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)


# --- security --------------------------------------------------------------------------------

_UNPICKLERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
               "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "cloudpickle.load",
               "cloudpickle.loads", "marshal.load", "marshal.loads", "shelve.open", "joblib.load"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """Calls in ``source`` that could unpickle: pickle-family loaders, ``torch.load`` without
    ``weights_only=True``, ``numpy.load`` with ``allow_pickle`` set; imports of them by name."""
    found = []
    tree = ast.parse(source, filename)
    aliases = {}  # local name -> dotted origin (from torch import load as tload)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        name = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        kwargs = {k.arg: k.value for k in node.keywords}
        where = f"{filename}:{node.lineno}: {name}"
        if name in _UNPICKLERS:
            found.append(where)
        elif name == "torch.load":
            w = kwargs.get("weights_only")
            if not (isinstance(w, ast.Constant) and w.value is True):
                found.append(where + " without weights_only=True")
        elif name in ("numpy.load", "np.load") and "allow_pickle" in kwargs:
            a = kwargs["allow_pickle"]
            if not (isinstance(a, ast.Constant) and a.value is False):
                found.append(where + " with allow_pickle")
    return found


def test_the_unpickling_scan_finds_what_it_looks_for():
    bad = ("import pickle, torch\nimport numpy as np\nfrom torch import load as tload\n"
           "pickle.loads(b)\ntorch.load(f)\ntorch.load(f, weights_only=False)\ntload(f)\n"
           "np.load(f, allow_pickle=True)\ntorch.load(f, weights_only=True)\nnp.load(f)\n")
    assert [w.split(": ")[1].split(" ")[0] for w in unsafe_loads(bad)] == \
        ["pickle.loads", "torch.load", "torch.load", "torch.load", "numpy.load"]


def test_package_source_never_unpickles():
    files = sorted((ROOT / "rewriter").rglob("*.py")) + sorted((ROOT / "passes").rglob("*.py"))
    assert len(files) > 20
    found = [w for f in files for w in unsafe_loads(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == []


def test_report_and_plan_are_written_as_json_and_read_without_unpickling(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")
    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    torch.manual_seed(0)
    model, x = HandAttention("mul").eval(), torch.randn(2, 16, 32)
    fast = rewriter.optimize(model, (x,), passes=["fuse_attention"], gate=QUICK, progress=False,
                             clock=ControlledClock(FAST))  # with profiling: the fullest save
    fast.report.save(tmp_path)
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert {"report.json", "plan.json", "report.md"} <= {p.name for p in written}
    for p in written:
        assert p.suffix in (".json", ".md", ".png", ".svg"), p
        if p.suffix == ".json":
            json.loads(p.read_text())
    replayed = _opt(model, (x,), passes=["fuse_attention"], plan=str(tmp_path / "plan.json"))
    assert replayed.report.kept_passes == ["fuse_attention"]
    for _ in range(2):  # the decision cache: written, then read back
        cached = _opt(model, (x,), passes=["fuse_attention"], cache_dir=str(tmp_path / "cache"))
    assert "decision cache" in cached.report.plan_status
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".json"
    json.loads(entries[0].read_text())
