"""Regional rewriting: each repeated block class decided once, installed in every instance.

The decisions come from a controlled clock; what is checked is where the rewrite runs (a pass
whose replacement counts its calls), that the module boundary stays (hooks, checkpointing),
and that undoing it leaves the classes exactly as they were.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule
from torch.utils.checkpoint import checkpoint

import rewriter
from rewriter import Pass, PassContext, Site
from rewriter.capture.blocks import BlockClass, calls_in_one_forward, find_blocks
from rewriter.capture.install import install
from rewriter.capture.ir import mark_new_node
from rewriter.capture.regional import RegionalCapture
from tests.controlled import QUICK, ControlledClock

CALLS = {"relu": 0}


def counted_relu(x: torch.Tensor) -> torch.Tensor:
    """F.relu that counts its calls: it runs only where the rewritten graph runs."""
    CALLS["relu"] += 1
    return F.relu(x)


class CountRelu(Pass):
    """Replaces each relu by ``counted_relu`` (same numerics)."""

    name = "count"
    contract = "exact"

    def find(self, gm: GraphModule, ctx: PassContext) -> list[Site]:
        return [Site(n, n.name) for n in gm.graph.nodes
                if n.op == "call_function" and n.target in (F.relu, torch.relu)]

    def apply(self, gm: GraphModule, sites: list[Site], ctx: PassContext) -> None:
        for site in sites:
            with gm.graph.inserting_after(site.anchor):
                new = gm.graph.call_function(counted_relu, tuple(site.anchor.args))
                mark_new_node(new, self.name, like=site.anchor)
            site.anchor.replace_all_uses_with(new)
            gm.graph.erase_node(site.anchor)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Stack(nn.Module):
    def __init__(self, n: int = 3, d: int = 16, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def _counts_from_zero_and_nothing_left_installed():
    from rewriter.capture import install as installs

    CALLS["relu"] = 0
    yield
    left = {id(o): o for p in list(installs._PATCHES.values())
            for o in (e[1]() for e in p.owners.values()) if o is not None}
    for inst in left.values():
        inst.remove()
    gc.collect()
    installs._purge()
    assert not installs._PATCHES


def _opt(model, inputs, **kw):
    kw.setdefault("knowledge_base", False)
    kw.setdefault("regional", True)
    return rewriter.optimize(model, inputs, passes=[CountRelu()], clock=ControlledClock({"count": 0.5}),
                             gate=QUICK, profile=False, progress=False, **kw)


def _calls(fn) -> int:
    before = CALLS["relu"]
    fn()
    return CALLS["relu"] - before


def _decision(fast, name="count"):
    return next(d for d in fast.report.decisions if d.pass_name == name)


# --- finding blocks ------------------------------------------------------------------------

def test_blocks_are_repeated_classes_outermost_with_parameters():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = Stack(n=3)
            self.acts = nn.ModuleList(nn.ReLU() for _ in range(3))     # torch.nn: operators
            self.linears = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    found = find_blocks(Outer())
    assert [(b.cls, [n for n, _ in b.instances]) for b in found] == \
        [(Block, ["stack.blocks.0", "stack.blocks.1", "stack.blocks.2"])]

    class Nested(nn.Module):  # blocks of blocks: the outer repeated class is the block
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Stack(n=2) for _ in range(2))

    assert [b.cls for b in find_blocks(Nested())] == [Stack]

    class Named(nn.Module):  # transformers names its block classes, even a single instance
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.only = Block(4)

    assert [(b.cls, len(b.instances)) for b in find_blocks(Named())] == [(Block, 1)]
    assert find_blocks(Block(4)) == []


class SharedStack(nn.Module):
    """One block, its weights shared by every layer (ALBERT's layout): called ``n`` times. The
    loop's count is read from the input's shape, which symbolic_trace cannot do (Dynamo can)."""

    def __init__(self, n: int = 3, d: int = 16) -> None:
        super().__init__()
        self.block, self.head, self.n = Block(d), nn.Linear(d, 4), n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n * x.shape[-1] // x.shape[-1]):
            x = self.block(x)
        return self.head(x)


def test_a_block_called_again_in_one_forward_is_a_block_once_counted():
    model, x = SharedStack(n=3), torch.randn(8, 16)
    assert find_blocks(model) == []  # nothing in the structure repeats
    calls = calls_in_one_forward(model, lambda: model(x))
    assert calls[id(model.block)] == 3 and calls[id(model.head)] == 1
    assert not model.block._forward_pre_hooks and not model._forward_pre_hooks  # hooks taken off
    (b,) = find_blocks(model, calls)
    assert (b.cls, [n for n, _ in b.instances], b.calls) == (Block, ["block"], 3)
    assert [b.calls for b in find_blocks(Stack(n=3))] == [3]  # one call an instance, uncounted
    single = Stack(n=1)
    for blocks, nests in (([b], True), ([BlockClass(Block, [("blocks.0", single.blocks[0])])], False)):
        cap = RegionalCapture(model if nests else single, "test", blocks)
        try:  # one instance, three calls: one nested compile region serves them; one call: none
            assert cap.nests is nests
        finally:
            cap.remove()


def test_a_block_shared_by_every_layer_is_decided_once_and_runs_at_every_call():
    torch.manual_seed(0)
    model, x = SharedStack(n=3).eval(), torch.randn(8, 16)
    want = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fast = _opt(model, (x,), regional="auto")
    assert fast.report.front_end == "regional", fast.report.front_end_reason
    assert "counted in one forward" in fast.report.front_end_reason
    (row,) = fast.report.blocks
    assert (row["class"], row["instances"], row["calls"]) == ("Block", 1, 3)
    assert "| Block | 1 (3 calls) |" in fast.report.to_markdown()
    assert _decision(fast).regions[0]["sites"] == 3  # the block's one site, run 3 times
    assert _calls(lambda: torch.testing.assert_close(fast(x), want)) == 3
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    fast.restore()


# --- installing ----------------------------------------------------------------------------

def test_install_runs_registered_engaged_instances_and_remove_restores_the_class_exactly():
    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.w

    class Inherits(Own):
        pass

    original = Own.__dict__["forward"]
    mine, other = Inherits(), Inherits()
    seen = []
    inst = install(Inherits, [mine], lambda m, fwd, a, k: seen.append(m) or fwd(m, *a, **k) + 1)
    x = torch.zeros(1)
    assert mine(x).item() == 0 and not seen  # installed, not engaged: the original forward
    inst.engaged = True
    assert mine(x).item() == 1 and seen == [mine]
    assert other(x).item() == 0 and seen == [mine]  # an instance not registered
    assert Own()(x).item() == 0  # the parent class is not touched
    inst.remove()
    assert "forward" not in Inherits.__dict__ and Inherits.forward is original
    assert mine(x).item() == 0 and seen == [mine]

    inst = install(Own, [mine], lambda m, fwd, a, k: fwd(m, *a, **k))
    assert Own.__dict__["forward"] is not original
    inst.remove()
    assert Own.__dict__["forward"] is original


# --- optimize() with blocks -----------------------------------------------------------------

def test_one_block_graph_decided_once_runs_in_every_instance_and_restore_undoes_it():
    torch.manual_seed(0)
    model, x = Stack(n=3).eval(), torch.randn(8, 16)
    want = model(x)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    fast = _opt(model, (x,))
    d = _decision(fast)
    assert fast.report.front_end == "regional"
    assert d.kept and d.regions[0]["sites"] == 3  # one site in the block's graph, run 3 times
    (row,) = fast.report.blocks
    assert row["class"] == "Block" and row["instances"] == 3 and row["graphs"] == ["Block.graph_0"]
    assert row["passes"] == ["count"]
    assert "## Blocks" in fast.report.to_markdown()

    assert _calls(lambda: torch.testing.assert_close(fast(x), want)) == 3
    # calling the model itself (not the wrapper) runs the rewritten blocks too
    assert _calls(lambda: torch.testing.assert_close(model(x), want)) == 3
    assert _calls(lambda: Stack(n=3)(x)) == 0  # another model's blocks run their own forward
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params

    assert Block.__dict__["forward"].__qualname__ != "Block.forward"  # the installed dispatcher
    fast.restore()
    assert Block.__dict__["forward"].__qualname__ == "Block.forward"
    assert _calls(lambda: torch.testing.assert_close(model(x), want)) == 0


def test_rewriter_restore_takes_the_installation_off_the_model():
    torch.manual_seed(0)
    model, x = Stack(n=2).eval(), torch.randn(4, 16)
    _opt(model, (x,))
    assert _calls(lambda: model(x)) == 2
    assert rewriter.restore(model) == 1
    assert _calls(lambda: model(x)) == 0 and Block.__dict__["forward"].__qualname__ == "Block.forward"
    assert rewriter.restore(model) == 0


def test_a_slower_block_rewrite_is_not_installed():
    torch.manual_seed(0)
    model, x = Stack(n=3).eval(), torch.randn(8, 16)
    fast = rewriter.optimize(model, (x,), passes=[CountRelu()], clock=ControlledClock({"count": 2.0}),
                             gate=QUICK, profile=False, progress=False, knowledge_base=False,
                             regional=True)
    assert not _decision(fast).kept
    assert _calls(lambda: fast(x)) == 0
    assert Block.__dict__["forward"].__qualname__ == "Block.forward"  # taken off again


class PlainBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class PlainStack(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PlainBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class ReluHead(nn.Module):
    """Blocks with nothing to rewrite; the relu the pass rewrites is in the head, outside the
    forward that calls the blocks (as a causal LM's head and loss are)."""

    def __init__(self, n: int = 2, d: int = 16) -> None:
        super().__init__()
        self.body = PlainStack(n, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.head(self.body(x)))


def test_a_rewrite_outside_the_blocks_keeps_the_installation_so_nothing_is_traced_again():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model, x = ReluHead(n=2).eval(), torch.randn(4, 16)
    want = model(x)
    fast = _opt(model, (x,))
    assert _decision(fast).kept
    assert fast.report.blocks[0]["rewritten"] is False
    # the graphs outside the blocks were captured with the blocks installed: they stay, engaged
    assert PlainBlock.__dict__["forward"].__qualname__ != "PlainBlock.forward"
    frames = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # as it was measured (an eval model: inference)
        assert _calls(lambda: torch.testing.assert_close(fast(x), want)) == 1  # the head's relu
    assert counters["stats"]["unique_graphs"] == frames  # the captured graphs ran: no new trace
    fast.restore()
    assert PlainBlock.__dict__["forward"].__qualname__ == "PlainBlock.forward"


def test_one_block_graph_whatever_the_depth():
    torch.manual_seed(0)
    rows = {}
    for n in (2, 6):
        fast = _opt(Stack(n=n).eval(), (torch.randn(8, 16),))
        rows[n] = fast.report.blocks[0]
        assert _decision(fast).regions[0]["sites"] == n
        fast.restore()
    assert rows[2]["graphs"] == rows[6]["graphs"] == ["Block.graph_0"]
    assert rows[2]["nodes"] == rows[6]["nodes"]


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_forward_hook_on_a_block_runs_at_every_call_while_the_rewrite_runs(when):
    torch.manual_seed(0)
    model, x = Stack(n=3).eval(), torch.randn(8, 16)
    fired = []

    def hook(m, args, out):
        fired.append(out.detach().clone())

    if when == "before":
        model.blocks[1].register_forward_hook(hook)
    fast = _opt(model, (x,))
    if when == "after":
        model.blocks[1].register_forward_hook(hook)
    fired.clear()
    with torch.no_grad():
        want = model.blocks[1](model.blocks[0](x))
    fired.clear()
    for _ in range(2):
        assert _calls(lambda: fast(x)) == 3
    assert len(fired) == 2
    torch.testing.assert_close(fired[-1], want)


@pytest.mark.timeout(300)  # wraps an engine (checkpointing): a hang fails the test
def test_torch_checkpoint_around_a_block_runs_the_rewrite_in_forward_and_recompute():
    torch.manual_seed(0)
    plain, ckpt = Stack(n=3), Stack(n=3, checkpointed=True)
    ckpt.load_state_dict(plain.state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    sites = {}
    for name, model in (("plain", plain), ("checkpointed", ckpt)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fast, _ = _opt(model, (x,), optimizer=opt, loss_fn=lambda out: F.mse_loss(out, y))
        d = _decision(fast)
        assert d.kept
        assert len(d.sites) == 3  # one per block: the recompute's graph is not more sites
        sites[name] = sorted(set(d.sites))
        # The recompute in backward is a graph of its own (Dynamo guards on the checkpoint's
        # context), identical to the forward's: the region runs 6 times a step, not 3.
        per_step = 6 if name == "checkpointed" else 3
        assert d.regions[0]["sites"] == per_step
        assert _calls(lambda: F.mse_loss(fast(x), y).backward()) == per_step
        fast.restore()
    assert sites["plain"] == sites["checkpointed"] == ["relu (in each Block)"]
    # losses equal, step by step
    torch.testing.assert_close(F.mse_loss(plain(x), y), F.mse_loss(ckpt(x), y))


def test_a_block_tensor_differing_between_instances_is_not_read_as_a_constant():
    class Scaled(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("same", torch.ones(4, 4, dtype=torch.bool).tril())
            self.register_buffer("scale", torch.tensor(s))

        def forward(self, x):
            return self.fc(x).masked_fill(~self.same, 0.0) * self.scale

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Scaled(1.0), Scaled(2.0)])

        def forward(self, x):
            for m in self.layers:
                x = m(x)
            return x

    model = Two()
    cap = RegionalCapture(model, "test", find_blocks(model))
    try:
        with torch.no_grad():
            cap(torch.randn(4, 4))
        (slot,) = [s for s in cap.slots if s.block == "Scaled"]
        static = {n.name: n.meta.get("static_value") for n in slot.original.graph.nodes
                  if n.op == "placeholder"}
        same = [k for k, v in static.items() if v is not None and v.dtype == torch.bool]
        scale = [k for k in static if "scale" in k]
        assert same and scale and all(static[k] is None for k in scale)
    finally:
        cap.remove()


def test_a_dropped_optimized_model_leaves_its_block_class_as_it_was():
    torch.manual_seed(0)
    model, x = Stack(n=2).eval(), torch.randn(4, 16)
    fast = _opt(model, (x,))
    assert Block.__dict__["forward"].__qualname__ != "Block.forward"
    del fast
    gc.collect()
    # unregistered at once: the model runs its own forward
    assert _calls(lambda: model(x)) == 0 and not hasattr(model.blocks[0], "_rewriter_installed")
    # the class is put back at the next call of ours (a collection may interrupt a Dynamo trace,
    # which must not see the class change under it)
    assert rewriter.restore(model) == 0
    assert Block.__dict__["forward"].__qualname__ == "Block.forward" and "__call__" not in Block.__dict__


def test_a_whole_model_capture_of_another_instance_traces_through_an_installed_class():
    # While one model's blocks are installed, Dynamo tracing another model of the same classes
    # sees the blocks' code as usual: one graph, its sites found.
    from rewriter.capture.front_ends import DynamoCapture

    class Pair(nn.Module):  # another model class (Dynamo skips Stack's looping forward once
        def __init__(self):  # the regional capture broke its graph at each block)
            super().__init__()
            self.a, self.b = Block(16), Block(16)

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    model, x = Stack(n=2).eval(), torch.randn(4, 16)
    fast = _opt(model, (x,))
    other = Pair().eval()
    cap = DynamoCapture(other, "test")
    with torch.no_grad():
        torch.testing.assert_close(cap(x), other(x))
    assert len(cap.slots) == 1
    assert sum(n.target is torch.relu for n in cap.slots[0].original.graph.nodes) == 2
    assert _calls(lambda: fast(x)) == 2


def test_a_new_input_shape_is_a_new_block_graph_that_gets_the_kept_rewrite():
    torch.manual_seed(0)
    model, x = Stack(n=3).eval(), torch.randn(8, 16)
    fast = _opt(model, (x,))
    other = torch.randn(5, 16)  # a shape optimize() never saw: captured again, the rewrite replayed
    assert _calls(lambda: torch.testing.assert_close(fast(other), _plain(model, other))) == 3
    assert len([s for s in fast._outcome.capture.slots if s.block == "Block"]) >= 2  # a graph of its own


def test_regional_false_and_the_fx_front_end_capture_the_whole_model_and_say_so():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    for kw in ({"regional": False}, {"regional": "auto", "front_end": "fx"}):
        fast = _opt(Stack(n=2).eval(), (x,), **kw)
        assert fast.report.front_end == "fx" and not fast.report.blocks
        assert _calls(lambda: fast(x)) == 2  # the rewritten whole graph
    plain = _opt(Block(16).eval(), (x,), regional=True)  # no repeated block: whole model, noted
    assert plain.report.front_end == "fx"
    assert any("no repeated block" in n for n in plain.report.notes)


def _plain(model, x):
    """The model's own forward, whatever is installed: each block's original forward."""
    with torch.no_grad():
        for b in model.blocks:
            x = x + torch.relu(b.fc(x))
        return model.head(x)


@pytest.mark.parametrize("front_end, speedup, noise, slower", [
    ("regional", 0.95, 0.03, True),    # 0.95 + 2 x 0.03 = 1.01 < 1.053 the regions predict
    ("regional", 0.95, 0.06, False),   # the upper bound (1.07) reaches the prediction
    ("regional", 0.99, 0.03, False),   # above the regression floor: not slower at all
    ("dynamo", 0.95, 0.03, False),     # no installed dispatch: the noise spans 1.0, regions stand
    ("regional", 0.90, 0.02, True),    # clear of the noise: slower by the usual rule too
])
def test_a_regional_step_check_that_falls_short_of_the_regions_prediction_is_slower(
        front_end, speedup, noise, slower):
    from types import SimpleNamespace

    from rewriter.decide.confirm import KeptUnit, _slower
    from rewriter.decide.gate import GateSettings
    units = [KeptUnit("fuse_attention", "sig", 1.5, 0.01, 1.5, 3), KeptUnit("fuse_rms_norm", "s2", 1.2, 0.01, 0.5, 7)]
    run = SimpleNamespace(cap=SimpleNamespace(front_end=front_end), units=units, dispatch_ms=0.0,
                          settings=SimpleNamespace(gate=GateSettings(), objective="time"))
    m = SimpleNamespace(pairs=12, busy=False, speedup=speedup, noise=noise, baseline_ms=40.0)
    assert _slower(m, run) is slower  # predicted: 2 ms of a 40 ms step, 1.053x


def test_recording_a_block_graph_ends_the_run_at_its_first_call(monkeypatch):
    """Recording region boundary values runs the model only until every graph with a region
    has recorded: a block graph records at its first call, so the later layers never run for
    it and recording costs the same at any depth."""
    from rewriter.decide.regions import RegionDecisions

    torch.manual_seed(0)
    model, x = Stack(n=4).eval(), torch.randn(8, 16)
    recording, later_layers = [False], []
    model.blocks[3].register_forward_hook(lambda m, a, out: later_layers.append(recording[0]))
    record = RegionDecisions._record

    def spied(self, regions):
        recording[0] = True
        try:
            values = record(self, regions)
        finally:
            recording[0] = False
        assert values is not None and all(values.values())  # every graph recorded its values
        return values
    monkeypatch.setattr(RegionDecisions, "_record", spied)
    fast = _opt(model, (x,))
    assert _decision(fast).kept
    assert later_layers and True not in later_layers  # the last layer ran, never while recording
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model.head(nn.Sequential(*model.blocks)(x)))


def test_a_regional_capture_is_checked_against_the_model_once(monkeypatch):
    """The check runs the whole model (forward and backward in training): a regional capture
    that passed it is not run through it again."""
    from rewriter.capture.choose import CaptureStage

    checks = []
    check = CaptureStage._capture_mismatch
    monkeypatch.setattr(CaptureStage, "_capture_mismatch",
                        lambda self, cap: checks.append(cap.front_end) or check(self, cap))
    torch.manual_seed(0)
    model, x = Stack(n=3), torch.randn(8, 16)
    fast, _ = _opt(model, (x,), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                   loss_fn=lambda out: out.pow(2).mean())
    assert fast.report.front_end == "regional" and _decision(fast).kept
    assert checks == ["regional"]


def test_the_forward_calling_the_blocks_is_neither_traced_nor_inlined_until_restore():
    """Dynamo would trace the forward that loops over the blocks up to the first block call
    (from its own frame, and inlined into its caller's) and drop the trace there: on the
    optimized model's own instance it is torch._dynamo.disable(recursive=False)'d while the
    blocks are installed (another instance of the class, its class, are untouched), and
    exactly as it was after restore."""
    class Loop(Stack):
        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = Loop(n=3)

        def forward(self, x):
            return self.stack(x).relu() * 2

    torch.manual_seed(0)
    model, other, x = Outer().eval(), Outer().eval(), torch.randn(8, 16)
    with torch.no_grad():
        want = model(x)
    fast = _opt(model, (x,))
    assert _decision(fast).kept and fast.report.front_end == "regional"
    marked = model.stack.__dict__.get("forward")
    assert marked is not None and marked.__func__._torchdynamo_disable is True
    assert "forward" not in other.stack.__dict__ and "forward" not in model.__dict__
    assert "_torchdynamo_disable" not in Loop.forward.__dict__
    with torch.no_grad():
        assert _calls(lambda: torch.testing.assert_close(fast(x), want)) == 3
    fast.restore()
    assert "forward" not in model.stack.__dict__
    with torch.no_grad():
        torch.testing.assert_close(model(x), want)


def test_the_dynamo_settings_of_our_calls_are_made_once_and_put_back_after_each(monkeypatch):
    """Every call of a captured model and of each installed block enters a Dynamo config patch;
    torch's patch() defines a class each time, so the patch is made once per limit and entered
    again (a generation calls the blocks dozens of times a step). Entered nested, from another
    thread, or after a failure, the user's settings come back."""
    import contextvars
    import threading

    import torch._dynamo.config as dynamo_config
    if not isinstance(getattr(dynamo_config.patch(recompile_limit=1), "_prior", None), contextvars.ContextVar):
        pytest.skip("this torch keeps a config patch's saved values on the object: one per call")
    torch.manual_seed(0)
    model, x = Stack(n=3).eval(), torch.randn(8, 16)
    fast = _opt(model, (x,))
    cap = fast.__dict__["_outcome"].capture
    made = []
    real = type(dynamo_config).patch

    def counted(self, *a, **k):
        made.append(k)
        return real(self, *a, **k)
    monkeypatch.setattr(type(dynamo_config), "patch", counted)
    before = dynamo_config.recompile_limit
    for _ in range(3):
        assert _calls(lambda: fast(x)) == 3
    assert made == [] and dynamo_config.recompile_limit == before  # reused, and put back
    outer = cap.dynamo_settings(recompile_limit=before + 7)
    assert cap.dynamo_settings(recompile_limit=before + 7) is outer
    seen, inside = [], threading.Barrier(2)

    def other_thread():  # enters the same object while this thread is inside it
        with outer:
            inside.wait(timeout=10)
            seen.append(("other", dynamo_config.recompile_limit))
        seen.append(("other after", dynamo_config.recompile_limit))
    with outer:
        with outer:  # nested: the same object entered twice
            seen.append(("nested", dynamo_config.recompile_limit))
        worker = threading.Thread(target=other_thread)
        worker.start()
        inside.wait(timeout=10)
        worker.join()
        seen.append(("outer", dynamo_config.recompile_limit))
    assert seen[:3] == [("nested", before + 7), ("other", before + 7), ("other after", seen[2][1])]
    assert seen[2][1] != before + 7 and seen[3] == ("outer", before + 7)
    assert dynamo_config.recompile_limit == before
    with pytest.raises(ZeroDivisionError), outer:
        1 / 0
    assert dynamo_config.recompile_limit == before
