"""fuse_linear_cross_entropy: the chunked loss against transformers' own loss and gradients,
the returned-logits rules, and the pass under optimize() (controlled clock and peaks)."""
import pytest
import torch
import torch.nn.functional as F

import rewriter
from passes import fuse_cross_entropy as fce
from passes import fuse_linear_cross_entropy as lce
from rewriter.capture.front_ends import capture
from rewriter.capture.ir import annotate_tensor_info, copy_graph_module
from rewriter.devices.backends import CpuBackend
from rewriter.pass_api import PassContext
from tests.controlled import QUICK, ControlledClock

transformers = pytest.importorskip("transformers")

PASS = lce.FuseLinearCrossEntropy()
# per dtype: fp32 up to accumulation-order rounding; bf16 as its GEMMs round
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}
VOCAB, SEQ = 96, 12


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=64, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def _inputs(ignore: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, :4] = -100   # a prompt
        labels[1, -3:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(run, model, inputs):
    model.zero_grad()
    out = run(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out, out.loss.detach(), grads


def _rewritten(model, inputs, objective="memory", training=True):
    """The model captured, with the pass applied to every graph (as optimize() builds it)."""
    cap = capture(model, (), inputs, "auto")
    cap(**inputs)  # Dynamo hands its graphs over at the first call
    ctx = PassContext(CpuBackend(), training, objective=objective)
    found = []
    for slot in cap.slots:
        found += slot.try_pass(PASS, ctx)
        slot.accept()
    return cap, found, ctx


@pytest.mark.parametrize("family", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("ignore", [False, True], ids=["all-tokens", "ignore_index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["one-chunk", "chunks-of-5"])
def test_fused_loss_matches_transformers_loss_and_gradients(family, ignore, dtype, chunk, monkeypatch):
    torch.manual_seed(0)
    model = family().to(dtype).train()
    inputs = _inputs(ignore)
    _, want_loss, want_grads = _loss_and_grads(model, model, inputs)
    if chunk is not None:
        monkeypatch.setattr(lce, "chunk_tokens", lambda *a: chunk)
    cap, found, _ = _rewritten(model, inputs)
    assert len(found) == 1
    out, got_loss, got_grads = _loss_and_grads(cap, model, inputs)
    assert out.logits is None  # dropped: objective="memory" in training
    torch.testing.assert_close(got_loss, want_loss, **TOL[dtype])
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("smoothing,softcap,reduction", [(0.1, None, "mean"), (0.0, 30.0, "mean"),
                                                        (0.2, 5.0, "sum")])
def test_label_smoothing_softcap_and_sum_match_torch(smoothing, softcap, reduction):
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(VOCAB, 16, requires_grad=True)
    b = torch.randn(VOCAB, requires_grad=True)
    t = torch.randint(0, VOCAB, (40,))
    t[::4] = -100
    z = F.linear(h, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    want = F.cross_entropy(z.float(), t, reduction=reduction, label_smoothing=smoothing)
    want_g = torch.autograd.grad(want * 0.7, (h, w, b))
    got = lce.fused_linear_cross_entropy(h, w, b, t, -100, reduction, smoothing, softcap, chunk=7)
    got_g = torch.autograd.grad(got * 0.7, (h, w, b))
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e, **TOL[torch.float32])


def test_every_token_ignored_is_nan_as_in_torch():
    h, w = torch.randn(6, 8), torch.randn(VOCAB, 8)
    t = torch.full((6,), -100)
    assert torch.isnan(F.cross_entropy(F.linear(h, w), t))
    assert torch.isnan(lce.fused_linear_cross_entropy(h, w, None, t))


def test_declines_when_a_graph_break_separates_lm_head_and_the_loss(monkeypatch):
    from transformers.loss.loss_utils import ForCausalLMLoss

    def breaking_loss(*args, **kwargs):
        torch._dynamo.graph_break()  # a print or a data-dependent branch in a custom loss
        return ForCausalLMLoss(*args, **kwargs)
    model = _gpt2().train()
    monkeypatch.setattr(type(model), "loss_function", property(lambda self: breaking_loss))
    cap, found, ctx = _rewritten(model, _inputs(ignore=False))
    assert len(cap.slots) > 1
    assert found == [] and any("another captured graph" in d for d in ctx.declined)


def test_gpt2_with_its_default_loss_type_is_one_graph_and_its_loss_is_fused():
    """GPT2LMHeadModel's loss_function calls logger.warning_once when loss_type is None (the
    class default); the capture lets Dynamo drop that call instead of breaking the graph."""
    model = _gpt2().train()
    assert model.loss_type is None
    cap, found, _ = _rewritten(model, _inputs(ignore=False))
    assert len(cap.slots) == 1 and len(found) == 1


def test_bad_arguments_are_clear_errors():
    h, w = torch.randn(6, 8), torch.randn(VOCAB, 8)
    with pytest.raises(ValueError, match="reduction"):
        lce.fused_linear_cross_entropy(h, w, None, torch.zeros(6, dtype=torch.long), reduction="none")
    with pytest.raises(ValueError, match="6 tokens but 5 targets"):
        lce.fused_linear_cross_entropy(h, w, None, torch.zeros(5, dtype=torch.long))


def test_chunks_are_about_the_hidden_states_size():
    assert lce.chunk_tokens(2048, 512, 32000) == (1 << 23) // 32000  # 262: GEMMs stay efficient
    assert lce.chunk_tokens(4, 8, 10) == 4       # tiny: one chunk
    assert lce.chunk_tokens(10, 8, 10**9) == 1   # at least one token


class LossAndMetric(torch.nn.Module):
    """Logits used twice: by the loss and by an accuracy metric."""

    def __init__(self, returns_logits: bool = False, metric: bool = True):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, VOCAB, bias=False)
        self.returns_logits, self.metric = returns_logits, metric

    def forward(self, x, y):
        logits = self.head(torch.relu(self.body(x)))
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1), ignore_index=-100)
        if self.metric:
            acc = (logits.argmax(-1) == y).float().mean()
            return loss, acc
        return (loss, logits) if self.returns_logits else loss


def _find(model, kwargs, objective="memory", training=True):
    cap = capture(model, (), kwargs, "auto")
    cap(**kwargs)
    ctx = PassContext(CpuBackend(), training, objective=objective)
    return [s for slot in cap.slots for s in PASS.find(copy_graph_module(slot.original), ctx)], ctx


@pytest.fixture
def xy():
    torch.manual_seed(0)
    return {"x": torch.randn(2, 5, 8), "y": torch.randint(0, VOCAB, (2, 5))}


def test_declines_when_the_logits_are_used_elsewhere(xy):
    sites, ctx = _find(LossAndMetric(metric=True), xy)
    assert sites == []
    assert any("the logits are used elsewhere" in d for d in ctx.declined)


def test_returned_logits_are_dropped_only_with_the_memory_objective_in_training(xy):
    model = LossAndMetric(returns_logits=True, metric=False)
    for objective, training in (("time", True), ("memory", False)):
        sites, ctx = _find(model, xy, objective, training)
        assert sites == [] and any("logits are returned" in d for d in ctx.declined)
    sites, _ = _find(model, xy, "memory", True)
    assert len(sites) == 1 and "output logits become None" in sites[0].description


def test_a_loss_without_returned_logits_is_fused_under_either_objective(xy):
    model = LossAndMetric(metric=False)
    for objective in ("time", "memory"):
        sites, _ = _find(model, xy, objective)
        assert len(sites) == 1 and "None" not in sites[0].description


def test_optimize_with_memory_objective_keeps_it_and_says_the_logits_are_dropped():
    torch.manual_seed(0)
    model = _llama().train()
    inputs = _inputs(ignore=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = ControlledClock(peaks={"fuse_linear_cross_entropy": 0.4})
    fast, _ = rewriter.optimize(model, inputs, optimizer=opt, passes=["fuse_linear_cross_entropy"],
                                clock=clock, gate=QUICK, profile=False, progress=False,
                                knowledge_base=False, objective="memory", time_budget=None)
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_linear_cross_entropy")
    assert d.kept and d.objective == "memory" and "-60%" in d.reason
    assert "outputs dropped (None) under objective='memory': ['output logits']" in d.verification
    assert any("logits" in n and "None" in n for n in fast.report.notes)
    out = fast(**inputs)
    assert out.logits is None
    torch.testing.assert_close(out.loss, model(**inputs).loss, **TOL[torch.float32])


def test_optimize_with_time_objective_leaves_the_logits(xy):
    torch.manual_seed(0)
    model = _llama().train()
    inputs = _inputs(ignore=False)
    fast = rewriter.optimize(model, inputs, passes=["fuse_linear_cross_entropy"],
                             clock=ControlledClock(peaks={"fuse_linear_cross_entropy": 0.4}),
                             gate=QUICK, profile=False, progress=False, knowledge_base=False)
    d = fast.report.decisions[0]
    assert not d.kept and d.status == "no sites" and "objective='memory'" in d.reason
    assert fast(**inputs).logits is not None


class PositionalLoss(torch.nn.Module):
    """A linear head and its loss."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, VOCAB, bias=False)

    def forward(self, x, y):
        logits = F.linear(x, self.head.weight)
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def test_a_positional_call_reads_each_argument_by_its_name(xy):
    # the traced call's arguments put in positions, as BERT's loss reached its Dynamo graph
    gm = torch.fx.symbolic_trace(PositionalLoss())
    annotate_tensor_info(gm, (xy["x"], xy["y"]), {})
    ce = next(n for n in gm.graph.nodes if n.target is F.cross_entropy)
    ce.args, ce.kwargs = (*ce.args, None, None, -100, None, "mean", 0.0), {}
    for p in (PASS, fce.FuseCrossEntropy()):
        ctx = PassContext(CpuBackend(), True, objective="memory")
        assert len(p.find(gm, ctx)) == 1, (p.name, ctx.declined)
