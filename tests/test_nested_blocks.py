"""The original model compiled whole traces each repeated block as one nested compile region a
class (``torch.compiler.nested_compile_region``; rewriter.capture.install's forward, switched on
by RegionalCapture.lifted(nest=True)): one region compiled for every instance, with Inductor's
buffer reuse off; none where a training step draws dropout and is verified with it off; a nested
compile that raises or fails verification is compiled again without regions. Under transformers' gradient
checkpointing the region is the checkpointed forward, never around the checkpoint (that form
gave wrong gradients under Inductor, torch 2.13)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from rewriter.capture.blocks import BlockClass, find_blocks
from rewriter.capture.install import FLAG, NESTED
from rewriter.capture.regional import RegionalCapture, _nested_instances
from rewriter.devices.compiled_loss import CACHEABLE
from tests.test_regional import Stack


class Recorder:
    """A torch.compile backend that keeps the graphs Dynamo hands it and runs them as they are."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        self.graphs.append(gm)
        return gm


def _region_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each invoke_subgraph call in ``gm`` runs (a checkpoint's body included)."""
    return [str(n.args[0].target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]


class Headed(nn.Module):
    """A stack of blocks under a model that adds a head: the model's trace calls the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Stack(n=3), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_lifted_traces_every_instance_of_a_block_as_one_region_and_puts_everything_back():
    torch.manual_seed(0)
    model, x = Headed().eval(), torch.randn(8, 16)
    with torch.no_grad():
        want = model(x)
    cap = RegionalCapture(model, "test", find_blocks(model))
    try:
        assert cap.nests
        rec = Recorder()
        compiled = torch.compile(model, backend=rec)
        with torch.no_grad(), cap.lifted(nest=True):
            assert all(b.__dict__.get(NESTED) and FLAG not in b.__dict__ for b in model.body.blocks)
            got = compiled(x)
        calls = [c for gm in rec.graphs for c in _region_calls(gm)]
        assert len(calls) == 3 and len(set(calls)) == 1, calls  # three calls of one region
        torch.testing.assert_close(got, want)
        assert all(FLAG in b.__dict__ and NESTED not in b.__dict__ for b in model.body.blocks)
        rec.graphs.clear()
        torch._dynamo.reset()
        with torch.no_grad(), cap.lifted():  # not asked to nest: each instance traced inline
            torch.testing.assert_close(torch.compile(model, backend=rec)(x), want)
        assert rec.graphs and not [c for gm in rec.graphs for c in _region_calls(gm)]
    finally:
        cap.remove()


def test_a_block_of_one_instance_called_once_is_not_nested():
    one, two, three, shared = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    blocks = [BlockClass(nn.Linear, [("head", one)]),
              BlockClass(nn.Linear, [("layers.0", two), ("layers.1", three)]),
              BlockClass(nn.Linear, [("shared", shared)], calls=4)]  # one instance, four calls
    assert _nested_instances(blocks, [one, two, three, shared]) == [two, three, shared]
    assert _nested_instances(blocks, [one, three]) == [three]  # only what lifted() turned off


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, attn_implementation="eager")
    return LlamaForCausalLM(cfg).train(), torch.randint(0, 64, (2, 8))


def _checkpoints_inside_regions(gm: torch.fx.GraphModule) -> int:
    """Activation checkpoints inside a nested region's subgraph (the form that gave wrong
    gradients under Inductor)."""
    inside = {str(n.args[0].target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
              for n in m.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)}
    return sum(1 for name in inside for n in getattr(gm, name).graph.nodes
               if "tag_activation_checkpoint" in str(n.target))


def test_transformers_gradient_checkpointing_keeps_the_region_inside_the_checkpoint():
    """The region is the forward transformers' checkpoint calls (a region around a checkpoint
    gave wrong gradients under Inductor, torch 2.13); the gradients are the eager ones."""
    model, ids = _tiny_llama()
    cap = RegionalCapture(model, "test", find_blocks(model))
    try:
        rec = Recorder()
        compiled = torch.compile(model, backend=rec)
        with cap.lifted(nest=True):
            compiled(input_ids=ids, labels=ids)
        assert len([c for gm in rec.graphs for c in _region_calls(gm)]) == 2  # without checkpointing
        model.gradient_checkpointing_enable()
        eager = model(input_ids=ids, labels=ids).loss
        want = torch.autograd.grad(eager, list(model.parameters()))
        rec.graphs.clear()
        with cap.lifted(nest=True):
            loss = compiled(input_ids=ids, labels=ids).loss
        got = torch.autograd.grad(loss, list(model.parameters()))
        assert any("tag_activation_checkpoint" in gm.code for gm in rec.graphs)
        assert not any(_checkpoints_inside_regions(gm) for gm in rec.graphs)
        torch.testing.assert_close(loss, eager)
        torch.testing.assert_close(got, want)
    finally:
        cap.remove()


class RecordingInductor(Recorder):
    """Stands in for Inductor (its name, and the ``config_patches`` it takes), AOTAutograd's
    eager backend underneath. ``nested``: what it does with a graph that calls a nested region
    ("raise", or "shift" its outputs: a miscompile)."""

    __name__ = "inductor"

    def __init__(self, nested: str | None = None) -> None:
        super().__init__()
        self.patches: list = []
        self.nested = nested

    def __call__(self, gm, example_inputs, config_patches=None):
        self.patches.append(config_patches)
        self.graphs.append(gm)
        regions = bool(_region_calls(gm))
        if regions and self.nested == "raise":
            raise RuntimeError("a region this compiler cannot take")
        # a region in a training graph runs through AOTAutograd (its backward is traced there)
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        if not (regions and self.nested == "shift"):
            return compiled
        return lambda *args: [t + 1.0 if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                              for t in compiled(*args)]


class DropBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.fc(x)))


class DropHeaded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.head = nn.ModuleList(DropBlock() for _ in range(3)), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _bf16_training(compiler, model_class=Headed, **kw):
    """optimize() of Headed in bf16 training under a regional capture: the original model under
    autocast, compiled, is the one candidate (and, timed by this clock, the faster)."""
    from tests.test_compile_gate import Bf16Cpu, ControlledClock, _opt

    torch.manual_seed(0)
    model, x = model_class().train(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = ControlledClock({"cast_to_half": 0.8, "compile": 0.7, "original": 0.5})
    fast, _ = _opt(model, (x,), clock, compiler, optimizer=opt, loss_fn=lambda out: out.float().pow(2).mean(),
                   passes=["cast_to_half"], dtype=torch.bfloat16, device=Bf16Cpu(), regional=True, **kw)
    return model, x, fast


def test_optimize_compiles_the_original_model_with_its_blocks_nested_and_inductors_buffer_reuse_off():
    """bf16 training under a regional capture: the one compile candidate, the original model
    under autocast, nests each repeated block (one region for the three instances) and is
    compiled with Inductor's buffer reuse off (a reused region's backward read a reused buffer
    in torch 2.13); kept, the blocks stay nested, and restore() takes that off."""
    rec = RecordingInductor()
    model, x, fast = _bf16_training(rec)
    torch.manual_seed(0)
    with torch.no_grad():
        want = Headed()(x)
    row, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert row.kept and row.sites == ["inductor (original model, blocks nested, autocast bfloat16)"], row
    assert rec.patches and all(p["allow_buffer_reuse"] is False for p in rec.patches)
    # CPU training: the losses' compiler forms are on, and AOTAutograd may cache their graphs
    assert all(set(CACHEABLE) <= set(p["unsafe_marked_cacheable_functions"]) for p in rec.patches)
    calls = [c for gm in rec.graphs for c in _region_calls(gm)]
    # the first block's input needs no gradient: a signature of its own, used once, inlined
    assert len(calls) == 2 and len(set(calls)) == 1, calls
    assert all(b.__dict__.get(NESTED) for b in model.body.blocks)  # lifted for good, nested
    assert fast.report.plan["compile"]["nested"] is True
    with torch.no_grad():
        torch.testing.assert_close(fast(x).float(), want, rtol=1.6e-2, atol=1e-2)
    fast.restore()
    assert not any(NESTED in b.__dict__ for b in model.body.blocks)


@pytest.mark.parametrize("how", ["raise", "shift"])
def test_nested_blocks_that_raise_or_miscompile_are_compiled_again_without_regions_and_remembered(how, tmp_path):
    """The nested form raises (a region torch cannot take: Mistral's output recording) or fails
    verification (OPT's outputs off): the original model is compiled again without regions, kept,
    both compiles counted; the knowledge base remembers, so the next run compiles once, and the
    plan says which form runs (a replay compiles that form)."""
    kb = tmp_path / "kb.json"
    rec = RecordingInductor(nested=how)
    model, x, fast = _bf16_training(rec, knowledge_base=kb)
    row, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    said = "raised" if how == "raise" else "failed verification"
    assert row.kept and row.sites == ["inductor (original model, autocast bfloat16)"], row
    assert f"with its blocks nested it {said}" in row.reason and "compiled again without them" in row.reason
    assert not any(NESTED in b.__dict__ for b in model.body.blocks)  # lifted for good, not nested
    assert fast.report.plan["compile"]["nested"] is False
    assert any(_region_calls(gm) for gm in rec.graphs) and not _region_calls(rec.graphs[-1])
    plan = fast.report.plan
    fast.restore()

    again = RecordingInductor(nested=how)
    _, _, fast2 = _bf16_training(again, knowledge_base=kb)
    row2, = [d for d in fast2.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert row2.kept and "nested" not in row2.reason and again.graphs
    assert not any(_region_calls(gm) for gm in again.graphs)  # straight to the form that verified
    fast2.restore()

    replayed = RecordingInductor(nested=how)
    _, _, fast3 = _bf16_training(replayed, plan=plan)
    assert [d.status for d in fast3.report.decisions if d.pass_name == "compile"] == ["replayed"]
    assert replayed.graphs and not any(_region_calls(gm) for gm in replayed.graphs)
    fast3.restore()


def test_a_training_step_that_draws_dropout_nests_only_where_verified_with_the_same_masks(monkeypatch):
    """Verified with dropout on, drawing eager's masks (CPU Inductor's fallback_random,
    rewriter.decide.same_masks), a step that draws dropout nests its blocks. Verified in a
    dropout-off compile (where the same masks are not drawn), a reused region kept its dropout
    there (OPT, torch 2.13), so that step is compiled whole without regions, once."""
    from rewriter.decide.compile_gate import CompileGate

    rec = RecordingInductor()
    _, _, fast = _bf16_training(rec, model_class=DropHeaded)
    row, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert row.kept and row.sites == ["inductor (original model, blocks nested, autocast bfloat16)"], row
    assert "the same masks" in row.verification, row.verification
    assert any(p["allow_buffer_reuse"] is False and p["fallback_random"] is True for p in rec.patches)
    fast.restore()

    monkeypatch.setattr(CompileGate, "_same_masks", lambda self, ex, original=True: False)
    rec = RecordingInductor()
    _, _, fast = _bf16_training(rec, model_class=DropHeaded)
    row, = [d for d in fast.report.decisions if d.pass_name == "compile" and d.status != "not tried"]
    assert row.kept and row.sites == ["inductor (original model, autocast bfloat16)"], row
    assert "nested" not in row.reason and rec.graphs and not any(_region_calls(gm) for gm in rec.graphs)
    assert fast.report.plan["compile"]["nested"] is False
    fast.restore()
