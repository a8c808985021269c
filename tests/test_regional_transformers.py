"""Regional rewriting on transformers models: checkpointing, eval and generate().

A tiny LLaMA (2 decoder layers); the decisions come from a controlled clock (every pass
faster), so what is checked is which sites are found, where the rewritten block graphs run,
and that the numbers and tokens are the model's.
"""
from __future__ import annotations

import pytest
import torch

import rewriter
from rewriter.capture.front_ends import GraphSlot
from tests.controlled import QUICK, ControlledClock

transformers = pytest.importorskip("transformers")
from tests.test_transformers import ALL_FASTER, LAYERS, VOCAB, _inputs, _llama  # noqa: E402


def _opt(model, inputs, **kw):
    return rewriter.optimize(model, inputs, clock=ControlledClock(ALL_FASTER), gate=QUICK,
                             progress=False, profile=False, knowledge_base=False, **kw)


@pytest.fixture
def block_runs(monkeypatch):
    """How many times block graphs ran, counted in GraphSlot.__call__."""
    runs = {"n": 0}
    real = GraphSlot.__call__

    def counted(self, *args, **kwargs):
        if self.block is not None:
            runs["n"] += 1
        return real(self, *args, **kwargs)
    monkeypatch.setattr(GraphSlot, "__call__", counted)
    return runs


@pytest.mark.timeout(300)  # wraps an engine (checkpointing): a hang fails the test
def test_gradient_checkpointing_finds_and_keeps_the_same_sites_and_the_loss_is_unchanged(block_runs):
    found = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = _llama().train()
        model.config.use_cache = False  # as transformers sets it under checkpointing: the same model
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        inputs = _inputs(True)
        want = model(**inputs).loss.item()
        fast = _opt(model, inputs)
        r = fast.report
        found[ckpt] = ({d.pass_name: len(d.sites) for d in r.decisions if d.sites}, r.kept_passes)
        assert r.front_end == "regional"
        block_runs["n"] = 0
        got = fast(**inputs).loss
        got.backward()
        # two layers, and with checkpointing each recomputes its forward in backward
        assert block_runs["n"] == (2 * LAYERS if ckpt else LAYERS)
        assert got.item() == pytest.approx(want, rel=1e-5)
        fast.restore()
    assert found[True] == found[False]
    assert found[False][0]["fuse_rms_norm"] == 2 * LAYERS + 1 and "fuse_rms_norm" in found[False][1]


def test_eval_and_generate_run_the_rewritten_blocks_and_give_the_same_tokens(block_runs):
    torch.manual_seed(0)
    model = _llama().eval()
    prompt = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=6, do_sample=False)
    fast = _opt(model, {"input_ids": prompt})
    assert fast.report.front_end == "regional" and fast.report.kept_passes
    block_runs["n"] = 0
    with torch.no_grad():
        got = fast.generate(prompt, max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # prefill and every decode step go through the block graphs (a decode step is a signature
    # of its own: captured once more, the kept rewrites replayed onto it)
    assert block_runs["n"] >= 6 * LAYERS
    fast.restore()


def test_many_models_optimized_in_one_process_each_keep_their_outer_graphs(monkeypatch):
    """transformers wraps every model class's forward in one shared function, which each
    optimize() compiles again: past Dynamo's recompile limit it ran uncaptured (the outer
    graphs gone). Dropped captures release their entries; live ones run past the limit."""
    import gc

    from rewriter.capture import code_entries, front_ends
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)  # the default (8), sooner
    # captures other tests keep alive own no entry now (Dynamo was reset), but would keep
    # shared code from being released: this test's captures are the only owners
    monkeypatch.setattr(code_entries, "_OWNERS", {})
    inputs = _inputs(True)

    def graphs():
        torch.manual_seed(0)
        fast = rewriter.optimize(_llama().train(), inputs, passes=[], progress=False, profile=False,
                                 knowledge_base=False, gate=QUICK)
        return fast, fast.report.graphs
    with monkeypatch.context() as m:
        m.setattr(front_ends, "CAPTURE_SIGNATURES", 1, raising=False)  # only the release can help
        dropped = []
        for _ in range(3):
            fast, n = graphs()
            dropped.append(n)
            del fast
            gc.collect()
        assert dropped == [dropped[0]] * 3 and dropped[0] > 1, dropped
    live = [graphs() for _ in range(3)]  # live captures: our calls raise the limit
    assert [n for _, n in live] == [dropped[0]] * 3, [n for _, n in live]


def _same_losses_under_the_same_seeds(ref, fast, inputs, seeds=(1, 2)):
    """Training losses with dropout on: each seed draws the same masks in both models."""
    for seed in seeds:
        torch.manual_seed(seed)
        want = ref(**inputs).loss
        torch.manual_seed(seed)
        got = fast(**inputs).loss
        assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_gpt2_with_dropout_is_captured_by_blocks_and_trains_as_the_original():
    """GPT-2's embedding dropout runs eagerly in the forward that loops over the blocks, outside
    every graph: the numerics check turns it off there too (it fell back to the whole model),
    and in training it draws as the original does."""
    import copy
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    assert cfg.embd_pdrop > 0 and cfg.resid_pdrop > 0  # transformers' defaults: dropout on
    model = transformers.GPT2LMHeadModel(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    fast = _opt(model, inputs, passes=["fuse_gelu"])
    assert fast.report.front_end == "regional", fast.report.notes
    _same_losses_under_the_same_seeds(ref, fast, inputs)
    torch.manual_seed(3)
    dropped = fast(**inputs).loss.item()
    torch.manual_seed(4)
    assert fast(**inputs).loss.item() != dropped  # dropout is on in training


def test_bart_functional_dropout_in_the_forward_that_loops_over_blocks_is_regional():
    """BART's encoder and decoder call ``F.dropout(x, p, training=self.training)`` in the forward
    that loops over their layers, outside every graph: the numerics check failed (the whole model
    was captured). While it runs, that forward's own ``training`` is False; training draws as
    the original does."""
    import copy
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    assert cfg.dropout > 0  # transformers' default
    model = transformers.BartForConditionalGeneration(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    fast = _opt(model, inputs, passes=[])
    r = fast.report
    assert r.front_end == "regional", r.notes
    assert {b["class"] for b in r.blocks} == {"BartEncoderLayer", "BartDecoderLayer"}
    assert model.model.encoder.training and model.model.decoder.training  # put back
    _same_losses_under_the_same_seeds(ref, fast, inputs)


def test_only_a_functional_dropout_call_turns_the_forwards_training_off_for_the_check():
    """An attribute named ``dropout`` is not a functional dropout: Wav2Vec2's encoder calls a
    dropout module and reads ``self.training`` for its layerdrop, which must stay as it is."""
    import torch.nn.functional as F
    from torch import nn

    from rewriter.capture.regional import _names_functional_dropout

    def functional(self, x):
        return F.dropout(x, self.dropout, self.training)

    def spelled_out(self, x):
        return nn.functional.dropout(x, p=0.1, training=self.training)

    def module(self, x):
        return self.dropout(x)

    def float_p(self, x):
        return self.layer(x, p=self.dropout)
    assert _names_functional_dropout(functional) and _names_functional_dropout(spelled_out)
    assert not _names_functional_dropout(module) and not _names_functional_dropout(float_p)
    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2Encoder
    assert not _names_functional_dropout(Wav2Vec2Encoder.forward)
    assert _names_functional_dropout(transformers.models.bart.modeling_bart.BartEncoder.forward)


@pytest.mark.timeout(300)  # wraps an engine (checkpointing): a hang fails the test
def test_gpt2_with_dropout_under_gradient_checkpointing_is_optimized():
    """The reference run turned dropout off as a torch-function mode, which checkpointing's
    recompute (in backward) does not see: a mask drawn only in the recompute broke its metadata
    check, and optimize() raised. Dropout modules are off as modules now."""
    import copy
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                                  use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    fast = _opt(model, inputs, passes=["fuse_gelu"])
    assert fast.report.front_end == "regional" and "fuse_gelu" in fast.report.kept_passes
    assert all(m.p == 0.1 for m in model.modules() if isinstance(m, torch.nn.Dropout))  # put back
    torch.manual_seed(1)
    want = ref(**inputs).loss
    torch.manual_seed(1)
    got = fast(**inputs).loss
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.timeout(300)
def test_functional_dropout_in_a_checkpointed_block_is_optimized():
    """A block that calls F.dropout with a float p (OPT, GPTBigCode), checkpointed: the reference
    run's dropout is off in the recompute too (functional dropout is the identity for its run)."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = F.dropout(torch.relu(x), p=0.1, training=self.training)  # mid-block, as OPT's
            return x + torch.tanh(self.fc(h))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x.sum()
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(4, 16)
    fast = rewriter.optimize(model, (x,), passes=[], progress=False, profile=False, knowledge_base=False,
                             gate=QUICK, regional=True)
    assert fast.report.front_end == "regional", fast.report.front_end_reason
    assert F.dropout.__name__ == "dropout"  # put back
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    assert fast(x).item() == pytest.approx(want.item(), rel=1e-5)
