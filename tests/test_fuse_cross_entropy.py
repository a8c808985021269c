"""fuse_cross_entropy: the loss and its gradient against F.cross_entropy (ignored rows, both
reductions, chunks, scaled and repeated backward), the declines, and the pass under optimize()
on a BERT-like and a GPT-2-like model (controlled clock)."""
import pytest
import torch
import torch.nn.functional as F

import rewriter
from passes import fuse_cross_entropy as fce
from rewriter.capture.front_ends import capture
from rewriter.capture.ir import copy_graph_module
from rewriter.devices.backends import CpuBackend
from rewriter.pass_api import PassContext
from tests.controlled import QUICK, ControlledClock

transformers = pytest.importorskip("transformers")

PASS = fce.FuseCrossEntropy()
# fp32; a log-softmax over up to 300 classes, the same kernel both ways: rounding of the
# softmax / count form and of a sum over up to 40 rows
TOL = dict(rtol=1e-5, atol=1e-6)


def _pair(rows=40, classes=300, ignored=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, classes, generator=g) * 4
    t = torch.randint(0, classes, (rows,), generator=g)
    t[:ignored] = -100
    return x, t


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignored", [0, 7], ids=["all-rows", "ignored-rows"])
@pytest.mark.parametrize("chunk_bytes", [None, 5 * 300 * 4], ids=["one-chunk", "chunks-of-5-rows"])
def test_loss_and_gradient_match_cross_entropy(reduction, ignored, chunk_bytes, monkeypatch):
    if chunk_bytes is not None:
        monkeypatch.setattr(fce, "CHUNK_BYTES", chunk_bytes)
    x, t = _pair(ignored=ignored)
    assert fce.chunk_rows(x) == (5 if chunk_bytes else 40)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, got = F.cross_entropy(a, t, reduction=reduction), fce.fused_cross_entropy(b, t, -100, reduction)
    torch.testing.assert_close(got, ref, **TOL)
    (ref * 1.5).backward()
    (got * 1.5).backward()
    torch.testing.assert_close(b.grad, a.grad, **TOL)


def test_every_row_ignored_is_a_nan_mean_and_zero_gradients_as_in_torch():
    x, t = _pair(rows=6, ignored=6)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, got = F.cross_entropy(a, t), fce.fused_cross_entropy(b, t)
    assert ref.isnan() and got.isnan()
    ref.backward()
    got.backward()
    assert torch.equal(a.grad, torch.zeros_like(x)) and torch.equal(b.grad, a.grad)


def test_a_graph_kept_for_several_backwards_gives_each_its_own_scale():
    # retain_graph: the gradient scaled in place by one factor is rescaled for the next
    x, t = _pair()
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, got = F.cross_entropy(a, t), fce.fused_cross_entropy(b, t)
    for factor in (2.0, 1.0, 0.0, -3.0, 1.0):
        want, = torch.autograd.grad(ref * factor, a, retain_graph=True)
        have, = torch.autograd.grad(got * factor, b, retain_graph=True)
        torch.testing.assert_close(have, want, **TOL)


def _grad_of(x, t):
    return torch.autograd.grad(fce.fused_cross_entropy(x, t), x)[0]


def test_the_gradient_buffer_is_reused_once_nothing_holds_it():
    fce.release_buffers()
    x, t = _pair(ignored=3)
    x.requires_grad_()
    first = _grad_of(x, t)
    where = first.data_ptr()
    del first  # the step is over: the buffer is free again
    again = _grad_of(x, t)
    assert again.data_ptr() == where
    torch.testing.assert_close(again, torch.autograd.grad(F.cross_entropy(x, t), x)[0], **TOL)


def test_a_loss_kept_after_its_backward_does_not_hold_the_buffer():
    # a training loop's `loss` lives on into the next step's forward
    fce.release_buffers()
    x, t = _pair(ignored=3)
    w = torch.eye(x.shape[1]).requires_grad_()
    spare = lambda: fce._SPARES.buffers[(x.dtype, x.device)][-1][0]  # noqa: E731
    losses, buffers = [], []
    for _ in range(3):
        losses.append(fce.fused_cross_entropy(x @ w, t))
        losses[-1].backward()
        buffers.append(spare())
    assert all(b is buffers[0] for b in buffers)  # one buffer, reused at every step
    want = torch.autograd.grad(F.cross_entropy(x @ w, t), w)[0]
    torch.testing.assert_close(w.grad, 3 * want, **TOL)


def test_a_gradient_still_held_is_never_overwritten():
    fce.release_buffers()
    x, t = _pair(ignored=3)
    y = x.clone().mul_(3).requires_grad_()
    x.requires_grad_()
    kept = _grad_of(x, t)  # a gradient the caller keeps
    pending = fce.fused_cross_entropy(y, t)  # a graph not yet backpropagated
    other = _grad_of(y, t)
    assert len({kept.data_ptr(), other.data_ptr()}) == 2
    torch.testing.assert_close(kept, torch.autograd.grad(F.cross_entropy(x, t), x)[0], **TOL)
    got, = torch.autograd.grad(pending, y)
    assert got.data_ptr() not in (kept.data_ptr(), other.data_ptr())
    torch.testing.assert_close(got, torch.autograd.grad(F.cross_entropy(y, t), y)[0], **TOL)
    torch.testing.assert_close(kept, torch.autograd.grad(F.cross_entropy(x, t), x)[0], **TOL)


def test_no_gradient_wanted_is_the_loss_only():
    x, t = _pair(ignored=3)
    with torch.no_grad():
        torch.testing.assert_close(fce.fused_cross_entropy(x, t), F.cross_entropy(x, t), **TOL)


# the fp32 gradient rounded once to the half dtype both ways; an fp32 ulp apart before rounding
# can land one half ulp apart after it
HALF_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("chunk_bytes", [None, 5 * 300 * 4], ids=["one-chunk", "chunks-of-5-rows"])
def test_half_logits_give_the_loss_and_gradient_of_their_fp32_upcast(dtype, chunk_bytes, monkeypatch):
    """Half logits (cast_to_half's, the model's own upcast dropped): the loss of their exact
    fp32 upcast, in fp32; the gradient in their dtype, the fp32 one rounded once as .float()'s
    backward rounds it; an incoming gradient of 0.5 scales it (one more rounding)."""
    if chunk_bytes is not None:
        monkeypatch.setattr(fce, "CHUNK_BYTES", chunk_bytes)
    x, t = _pair(ignored=7)
    x = x.to(dtype)
    assert fce.chunk_rows(x) == (5 if chunk_bytes else 40)  # rows of fp32 work, not of half logits
    for scale in (1.0, 0.5):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref, got = F.cross_entropy(a.float(), t), fce.fused_cross_entropy(b, t)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, **TOL)
        (ref * scale).backward()
        (got * scale).backward()
        assert b.grad.dtype == dtype
        torch.testing.assert_close(b.grad, a.grad, **HALF_TOL[dtype])


class UpcastHead(torch.nn.Module):
    """transformers' ForCausalLMLoss in small: the logits returned, their fp32 upcast flattened
    into the loss."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 30)

    def forward(self, x, y):
        logits = self.proj(x)
        return F.cross_entropy(logits.float().view(-1, 30), y.view(-1)), logits


def test_the_dropped_upcast_is_the_sites_own_so_the_loss_is_decided_on_its_region():
    """The upcast the rewrite drops (and the flattening it retypes) are covered by the site:
    one region holds them with the loss, and the loss is measured there, not on the whole step
    (on LLaMA, bf16, 0.7 s of deciding instead of 2.2 s)."""
    torch.manual_seed(0)
    model = UpcastHead()
    kwargs = {"x": torch.randn(4, 6, 8), "y": torch.randint(0, 30, (4, 6))}
    gm = capture(model, (), kwargs).slots[0].original
    site, = fce.FuseCrossEntropy().find(gm, PassContext(CpuBackend(), training=True))
    assert [n.target for n in site.covers] == ["view", "float"]
    fast, _ = rewriter.optimize(model, kwargs, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                loss_fn=lambda out: out[0], passes=["fuse_cross_entropy"],
                                clock=ControlledClock(costs={"fuse_cross_entropy": 0.7}),
                                gate=QUICK, profile=False, progress=False, knowledge_base=False)
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_cross_entropy")
    assert d.kept and d.scope == "site" and d.reason.startswith("region"), d.reason
    region, = d.regions
    assert region["boundary"][0].startswith("float32[4, 6, 30]")  # from the logits, upcast in


def test_the_logits_own_upcast_is_dropped_so_half_logits_reach_the_loss_as_they_are():
    """Under optimize(dtype=bf16) with cast_to_half kept, the projection's bf16 output reaches
    the fused loss through the flattening only: no whole fp32 copy of the logits, none of their
    gradient back; the training step stays within bf16's tolerance of fp32's."""
    from rewriter.capture.ir import is_op
    from tests.controlled import Bf16Cpu
    torch.manual_seed(0)
    model = UpcastHead()
    twin = UpcastHead()
    twin.load_state_dict(model.state_dict())
    kwargs = {"x": torch.randn(4, 6, 8), "y": torch.randint(0, 30, (4, 6))}
    fast, opt = rewriter.optimize(model, kwargs, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  loss_fn=lambda out: out[0], dtype=torch.bfloat16, device=Bf16Cpu(),
                                  passes=["fuse_cross_entropy", "cast_to_half"],
                                  clock=ControlledClock(costs={"fuse_cross_entropy": 0.7, "cast_to_half": 0.7}),
                                  gate=QUICK, profile=False, progress=False, knowledge_base=False)
    assert fast.report.kept_passes == ["fuse_cross_entropy", "cast_to_half"]
    graph = fast._outcome.capture.slots[0].kept_run.graph
    loss, = [n for n in graph.nodes if n.target is fce.fused_cross_entropy]
    flat = loss.args[0]
    assert is_op(flat, "view") and is_op(flat.args[0], "linear"), graph  # no cast between
    out, ref = fast(**kwargs), twin(**kwargs)
    torch.testing.assert_close(out[0], ref[0], rtol=1.6e-2, atol=1e-2)
    out[0].backward()
    ref[0].backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1.6e-2, atol=1e-2, msg=name)
    fast.restore()


class Head(torch.nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.proj, self.loss = torch.nn.Linear(8, 30), loss

    def forward(self, x, y):
        return self.loss(self.proj(x).view(-1, 30), y.view(-1))


def _find(loss, dtype=torch.float32):
    torch.manual_seed(0)
    model = Head(loss).to(dtype)
    kwargs = {"x": torch.randn(2, 5, 8, dtype=dtype), "y": torch.randint(0, 30, (2, 5))}
    cap = capture(model, (), kwargs, "auto")
    cap(**kwargs)
    ctx = PassContext(CpuBackend(), True)
    return [s for slot in cap.slots for s in PASS.find(copy_graph_module(slot.original), ctx)], ctx


@pytest.mark.parametrize("loss", [
    torch.nn.CrossEntropyLoss(),  # reaches the graph positionally (size_average=None, ...)
    lambda z, y: F.cross_entropy(z, y, ignore_index=-1, reduction="sum"),
], ids=["module", "functional"])
def test_finds_the_loss_however_it_is_called(loss):
    sites, ctx = _find(loss)
    assert len(sites) == 1, ctx.declined


@pytest.mark.parametrize("loss, reason", [
    (lambda z, y: F.cross_entropy(z, y, label_smoothing=0.1), "label smoothing"),
    (lambda z, y: F.cross_entropy(z, y, weight=torch.ones(30)), "class-weighted"),
    (lambda z, y: F.cross_entropy(z, y, reduction="none").sum(), "reduction='none'"),
])
def test_declines_what_it_does_not_compute(loss, reason):
    sites, ctx = _find(loss)
    assert sites == [] and any(reason in d for d in ctx.declined), ctx.declined


def test_declines_half_precision_logits():
    sites, ctx = _find(torch.nn.CrossEntropyLoss(), torch.bfloat16)
    assert sites == [] and any("torch.bfloat16" in d for d in ctx.declined)


def _bert():
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=96, max_position_embeddings=32,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  attn_implementation="eager")
    return transformers.BertForMaskedLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=32, vocab_size=96,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("family", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_optimize_keeps_it_when_faster_and_the_training_step_is_unchanged(family):
    torch.manual_seed(0)
    model = family().train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    inputs = {"input_ids": ids, "labels": labels}
    twin = family().train()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast, opt = rewriter.optimize(model, inputs, optimizer=opt, passes=["fuse_cross_entropy"],
                                  clock=ControlledClock(costs={"fuse_cross_entropy": 0.7}),
                                  gate=QUICK, profile=False, progress=False, knowledge_base=False)
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_cross_entropy")
    assert d.kept, d.reason
    out = fast(**inputs)
    assert out.logits is not None  # the logits stay
    ref = twin(**inputs)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_optimize_rejects_it_when_slower():
    torch.manual_seed(0)
    model = _bert().train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    fast, _ = rewriter.optimize(model, {"input_ids": ids, "labels": ids},
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                passes=["fuse_cross_entropy"],
                                clock=ControlledClock(costs={"fuse_cross_entropy": 1.4}),
                                gate=QUICK, profile=False, progress=False, knowledge_base=False)
    d = next(d for d in fast.report.decisions if d.pass_name == "fuse_cross_entropy")
    assert not d.kept and d.status == "rejected"


class Casts(torch.nn.Module):
    def forward(self, x, y):
        return (x.float(), x.to(torch.float32), x.type_as(y), x.to(torch.float16),
                x.to(torch.float32, memory_format=torch.channels_last))


def test_an_upcast_to_fp32_is_recognised_by_what_it_changes():
    from rewriter.capture.ir import annotate_tensor_info, is_upcast_to_fp32
    gm = torch.fx.symbolic_trace(Casts())
    annotate_tensor_info(gm, (torch.randn(2, 3, 4, 5, dtype=torch.bfloat16), torch.randn(1)), {})
    casts = [n for n in gm.graph.nodes if n.op == "call_method"]
    # .float(), .to(fp32), .type_as(an fp32 tensor): only the dtype changes; a cast to fp16 is no
    # upcast to fp32, and one that lays the tensor out anew (channels-last) changes its strides
    assert [is_upcast_to_fp32(n) for n in casts] == [True, True, True, False, False]
