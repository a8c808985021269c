"""The generation workload: an eval-mode causal LM is decided on a prefill and decode calls.

A tiny LLaMA (2 decoder layers); decisions come from a controlled clock (every pass faster), so
what is checked is what the step is made of, which block graphs exist and run for prefill and
decode, that the tokens are the original model's, and that a new length is served without a
new decision.
"""
from __future__ import annotations

import functools

import pytest
import torch

import rewriter
from rewriter.capture.front_ends import GraphSlot
from rewriter.decide.generation import DEFAULT_DECODE_CALLS, Generation, GenerationUnavailable, check_generate
from tests.controlled import QUICK, ControlledClock
from tests.models import ReluMLP

transformers = pytest.importorskip("transformers")
from tests.test_transformers import ALL_FASTER, LAYERS, VOCAB, _llama  # noqa: E402

PROMPT = 8


def _opt(model, inputs, clock=None, **kw):
    return rewriter.optimize(model, inputs, clock=clock or ControlledClock(ALL_FASTER), gate=QUICK,
                             progress=False, profile=False, knowledge_base=False, compile=False, **kw)


def _prompt(length=PROMPT, batch=1, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def _greedy(model, prompt, n):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.fixture
def block_graph_calls(monkeypatch):
    """Which block graphs ran, and how often, counted in GraphSlot.__call__."""
    calls: dict[str, int] = {}
    real = GraphSlot.__call__

    def counted(self, *args, **kwargs):
        if self.block is not None:
            calls[self.name] = calls.get(self.name, 0) + 1
        return real(self, *args, **kwargs)
    monkeypatch.setattr(GraphSlot, "__call__", counted)
    return calls


def test_greedy_tokens_are_the_ones_generate_picks():
    torch.manual_seed(0)
    model = _llama().eval()
    prompt = _prompt()
    gen = Generation.greedy(model, (prompt,), {}, decode=5)
    assert gen.decode_calls == 5
    torch.testing.assert_close(gen.tokens, _greedy(model, prompt, 5)[:, PROMPT:], rtol=0, atol=0)
    outputs = gen.run(model)
    # generate() asks for the last position's logits only (logits_to_keep): so does the replay
    assert [tuple(o.shape) for o in outputs] == [(1, 1, VOCAB)] * 6


def test_the_calls_are_generates_own_replayed_teacher_forced_from_an_empty_cache():
    torch.manual_seed(0)
    model = _llama().eval()
    ids = _prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: generate() passes the mask on, and positions from it
    made = []
    forward = model.forward

    @functools.wraps(forward)
    def spy(*args, **kwargs):
        made.append({k: v for k, v in kwargs.items()})
        return forward(*args, **kwargs)
    model.forward = spy
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    del model.forward
    gen = Generation.greedy(model, (), {"input_ids": ids, "attention_mask": mask}, decode=3)
    seen = []

    def replayed(**kwargs):
        seen.append(kwargs)
        return model(**kwargs)
    for _ in range(2):  # every step starts from an empty cache: the same calls, the same logits
        seen.clear()
        logits = gen.run(replayed)
        assert [set(k) for k in seen] == [set(k) for k in made]  # the keywords generate passes
        assert "logits_to_keep" in seen[0]  # read from forward's signature, as generate() does
        assert [k["attention_mask"].shape[1] for k in seen] == [PROMPT, PROMPT + 1, PROMPT + 2, PROMPT + 3]
        for i, k in enumerate(seen[1:]):
            torch.testing.assert_close(k["input_ids"], gen.tokens[:, i:i + 1], rtol=0, atol=0)
        cache = seen[0][gen.cache_arg]
        assert cache is not gen.empty_cache and cache.get_seq_length() == PROMPT + 3
        assert gen.empty_cache.get_seq_length() == 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[:, -1:]
    torch.testing.assert_close(logits[0], want)


def test_the_warm_up_shows_a_prompt_one_token_shorter_and_two_decode_calls():
    torch.manual_seed(0)
    model = _llama().eval()
    gen = Generation.greedy(model, (_prompt(),), {}, decode=4)
    seen = []

    def spy(**kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        return model(**kwargs)
    gen.warm_up(spy)
    assert seen == [PROMPT - 1, 1, 1]


@pytest.mark.parametrize("inputs, problem", [
    (((torch.randn(1, 4),), {}), "token ids"),
    (((), {"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None]}),
     "position_ids"),
    (((), {"input_ids": torch.zeros(1, 4, dtype=torch.long), "use_cache": False}), "use_cache=False"),
    (((), {"input_ids": torch.zeros(1, 32, dtype=torch.long)}), "no room"),  # fills the 32 positions
])
def test_a_prompt_with_no_decode_form_is_named(inputs, problem):
    model = _llama().eval()
    with pytest.raises(GenerationUnavailable, match=problem):
        Generation.greedy(model, *inputs, decode=2)


def test_a_model_that_returns_no_cache_is_decided_on_one_call_with_a_note():
    """A config with use_cache=False (MPT's default): generate() runs without a cache, so there
    is no decode call to replay; optimize() decides the one call and says why."""
    torch.manual_seed(0)
    model = _llama().eval()
    model.config.use_cache = False
    model.generation_config.use_cache = False
    with pytest.raises(GenerationUnavailable, match="no KV cache"):
        Generation.greedy(model, (_prompt(),), {}, decode=2)
    prompt = _prompt()
    want = _greedy(model, prompt, 4)
    fast = _opt(model, (prompt,))
    r = fast.report
    assert not r.workload.startswith("generate") and any("no KV cache" in n for n in r.notes), r.notes
    torch.testing.assert_close(_greedy(fast, prompt, 4), want, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "yes", None])
def test_generate_argument_is_checked(bad):
    with pytest.raises(ValueError, match="generate must be"):
        check_generate(bad)
    assert check_generate(1) == 1 and check_generate(True) is True and check_generate("auto") == "auto"


def test_eval_causal_lm_is_decided_on_prefill_and_decode_and_generate_runs_both(block_graph_calls):
    torch.manual_seed(0)
    model = _llama().eval()
    prompt = _prompt()
    want = _greedy(model, prompt, 12)
    fast = _opt(model, (prompt,))
    r = fast.report
    assert r.front_end == "regional" and r.kept_passes
    assert f"{DEFAULT_DECODE_CALLS} decode calls" in r.workload and "step: generate" in r.to_markdown()
    assert r.plan["fingerprint"]["decode_calls"] == DEFAULT_DECODE_CALLS
    (block,) = r.blocks
    assert len(block["graphs"]) >= 2  # the prefill's and the decode's (at least)
    decided = {s.name for s in fast._outcome.capture.slots}
    block_graph_calls.clear()
    got = _greedy(fast, prompt, 12)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the prefill graph ran once per layer, a decode graph for each of the 11 decode calls
    assert sum(block_graph_calls.values()) == 12 * LAYERS
    assert len(block_graph_calls) >= 2
    # a kept rewrite is in the decode graph generate runs
    busiest = max(block_graph_calls, key=block_graph_calls.get)
    assert set(block_graph_calls) <= decided  # decided on, not met for the first time in generate
    slot = next(s for s in fast._outcome.capture.slots if s.name == busiest)
    assert slot.kept is not slot.original
    fast.restore()


def test_a_new_prompt_length_is_served_without_deciding_again(block_graph_calls):
    torch.manual_seed(0)
    model = _llama().eval()
    fast = _opt(model, (_prompt(),))
    cap = fast._outcome.capture
    before = {s.name for s in cap.slots}
    decisions = [(d.pass_name, d.status) for d in fast.report.decisions]
    other = _prompt(length=PROMPT + 5, seed=4)
    want = _greedy(model, other, 6)
    block_graph_calls.clear()
    got = _greedy(fast, other, 6)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # no new block graph: the prefill graph decided on is dynamic in the prompt's length and
    # the decode graph in the cache's (traced so from their first call)
    assert not [s for s in cap.slots if s.name not in before and s.block is not None]
    assert sum(block_graph_calls.values()) == 6 * LAYERS
    assert set(block_graph_calls) <= before
    ran = [s for s in cap.slots if s.name in block_graph_calls]
    assert all(s.kept is not s.original for s in ran)  # and they run rewritten
    assert [(d.pass_name, d.status) for d in fast.report.decisions] == decisions
    fast.restore()


def test_generate_false_decides_on_one_call_and_true_insists():
    torch.manual_seed(0)
    model = _llama().eval()
    fast = _opt(model, (_prompt(),), generate=False)
    assert fast.report.workload == "" and "decode_calls" not in fast.report.plan["fingerprint"]
    fast.restore()
    with pytest.raises(ValueError, match=r"generate=True\): ReluMLP has no generate\(\)"):
        _opt(ReluMLP().eval(), (torch.randn(2, 16),), generate=True)


def test_auto_on_a_model_that_does_not_generate_is_one_call():
    fast = _opt(ReluMLP().eval(), (torch.randn(2, 16),))
    assert fast.report.workload == ""


def test_auto_on_a_prompt_with_no_decode_form_says_so():
    torch.manual_seed(0)
    model = _llama().eval()
    ids = _prompt()
    fast = _opt(model, {"input_ids": ids, "position_ids": torch.arange(PROMPT)[None]})
    assert fast.report.workload == ""
    assert any("generate='auto': the step is one call" in n and "position_ids" in n for n in fast.report.notes)
    fast.restore()


def test_measuring_the_generation_leaves_the_model_and_rng_untouched():
    torch.manual_seed(0)
    model = _llama().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    fast = _opt(model, (_prompt(),))
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    assert not model.training
    fast.restore()


class CountingBackend:
    """A torch.compile backend that runs each graph as it is and counts compiles and runs."""

    __name__ = "counting"

    def __init__(self):
        self.compiles = self.runs = 0
        self.inputs = []  # each compile's example inputs

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        self.inputs.append(list(example_inputs))

        def run(*args):
            self.runs += 1
            return gm(*args)
        return run


def test_a_kept_compile_of_the_original_model_serves_generate_and_new_lengths_without_compiling():
    """Nothing rewritten kept (every pass slower), the compiled model faster: the model's own
    forward, compiled whole (the installed blocks lifted), is what fast.generate() calls for
    each decode call, the prefill runs the forward uncompiled, and the decode graph decided on
    is dynamic in the cache's length (no compile at a new prompt length), with the modules'
    float attributes as constants (not inputs Inductor would trace the model again for)."""
    torch.manual_seed(0)
    model = _llama().eval()
    prompt = _prompt()
    want = _greedy(model, prompt, 6)
    backend = CountingBackend()
    slower = {name: 1.2 for name in rewriter.registered_passes()}
    fast = rewriter.optimize(model, (prompt,), clock=ControlledClock({**slower, "compile": 0.5}), gate=QUICK,
                             progress=False, profile=False, knowledge_base=False, compile=backend)
    row = next(d for d in fast.report.decisions if d.pass_name == "compile")
    assert row.kept and fast.report.final["compiled"] == "counting", row.reason
    assert not fast.report.kept_passes[:-1] and "forward" not in model.__dict__
    compiles = backend.compiles
    # one graph for every decode call: the first (the prefill's cache layout) is not a graph
    # of its own, and the prefill is not compiled
    assert compiles == 1, compiles
    assert not any(isinstance(x, (float, torch.SymFloat)) for x in backend.inputs[0]), backend.inputs[0]
    backend.runs = 0
    got = _greedy(fast, prompt, 6)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert backend.runs == 5 and backend.compiles == compiles  # the decode calls, as decided on
    backend.runs = 0
    _greedy(fast, prompt, 1)  # the prefill alone
    assert backend.runs == 0
    other = _prompt(length=PROMPT + 5, seed=4)
    torch.testing.assert_close(_greedy(fast, other, 4), _greedy(model, other, 4), rtol=0, atol=0)
    assert backend.compiles == compiles
    assert "forward" not in model.__dict__  # the compiled forward is in place only during a call
    # the model itself, called directly, is its own code: only fast's generate is compiled
    backend.runs = 0
    _greedy(model, prompt, 2)
    assert backend.runs == 0
    fast.restore()  # from now on the original model runs, not compiled either
    _greedy(fast, prompt, 2)
    assert backend.runs == 0


def test_the_recording_is_greedy_with_one_beam_whatever_the_generation_config_says():
    torch.manual_seed(0)
    model = _llama().eval()
    prompt = _prompt()
    want = _greedy(model, prompt, 3)
    model.generation_config.num_beams, model.generation_config.do_sample = 3, True
    gen = Generation.greedy(model, (prompt,), {}, decode=3)
    assert gen.calls[0]["input_ids"].shape[0] == 1  # one beam: the batch is the prompt's
    torch.testing.assert_close(gen.tokens, want[:, PROMPT:], rtol=0, atol=0)


def test_an_encoder_decoder_model_is_decided_on_one_call():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                num_decoder_layers=1, num_heads=4, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with pytest.raises(GenerationUnavailable, match="encoder-decoder"):
        Generation.greedy(model, (_prompt(),), {}, decode=2)


@pytest.mark.parametrize("installed_cost, kept", [(15.0, False), (1.0, True)])  # 140 ms vs 90 ms saved
def test_regions_that_cannot_pay_for_the_installed_graphs_are_reverted(installed_cost, kept):
    """The composed step level with the original (the step check cannot resolve it): the kept
    regions stand on their own measurements, unless the installed graphs, timed once before any
    rewrite, cost more a step than the regions predict they save (then, when even the upper
    end of the regions' figures cannot pay for them, no step check is timed)."""
    from rewriter.pipeline import INSTALLED
    torch.manual_seed(0)
    model = _llama().eval()
    clock = ControlledClock({"fuse_rms_norm": 0.8, INSTALLED: installed_cost},
                            step_costs={"fuse_rms_norm": 1.0}, jitter=0.002)
    fast = _opt(model, (_prompt(),), clock=clock, passes=["fuse_rms_norm"])
    r = fast.report
    assert ("fuse_rms_norm" in r.kept_passes) is kept, r.final["reason"]
    if kept:
        assert "cannot resolve" in r.final["reason"]
    else:
        assert "less than the" in r.final["reason"] and "installed graphs cost" in r.final["reason"]
        assert any("before any rewrite" in n for n in r.notes)
        # the regions' upper bound is below the installed graphs' cost: no step was timed for it
        assert "without a step check" in r.final["reason"] and "measurement" not in r.final
    fast.restore()


def test_a_compiled_forward_gets_the_dynamic_cache_contiguous_and_its_values_unchanged():
    """The compiled prefill leaves the cache in its projections' layout (heads before
    positions), a decode call leaves it contiguous; CompiledForward shows its compiled forward the cache
    contiguous, so the first decode call is not a graph of its own (with Inductor: 3 -> 2 graphs
    for a generate, Qwen2). Other cache layers keep their tensors."""
    from transformers.cache_utils import DynamicCache

    from rewriter.devices.executors import contiguous_cache
    keys = torch.randn(1, 5, 2, 16).transpose(1, 2)  # [batch, heads, positions, dim], as projected
    values = torch.randn(1, 5, 2, 16).transpose(1, 2)
    cache = DynamicCache()
    cache.update(keys, values, 0)
    # as the prefill compiled by Inductor leaves them (eager's first update copies them)
    cache.layers[0].keys, cache.layers[0].values = keys, values
    contiguous_cache(cache)
    layer = cache.layers[0]
    assert layer.keys.is_contiguous() and layer.values.is_contiguous()
    torch.testing.assert_close(layer.keys, keys, rtol=0, atol=0)
    torch.testing.assert_close(layer.values, values, rtol=0, atol=0)

    class OtherLayer(type(layer)):  # a subclass (sliding window, quantized) is left alone
        pass
    other = DynamicCache()
    other.update(keys, values, 0)
    other.layers[0].keys = keys
    other.layers[0].__class__ = OtherLayer
    contiguous_cache(other)
    assert other.layers[0].keys is keys
    contiguous_cache(keys)  # not a cache: nothing happens
    assert not keys.is_contiguous()


def test_a_static_cache_generation_is_decided_and_served_with_the_original_tokens(block_graph_calls):
    """transformers' static cache (``cache_implementation="static"``: fixed shapes, the
    compiler's friend) is the cache kind generate() builds; the step is recorded and replayed
    with it, the rewritten block graphs serve it, and the tokens are the original model's, at
    the prompt's length and at one never seen."""
    torch.manual_seed(0)
    model = _llama().eval()
    model.generation_config.cache_implementation = "static"
    prompt = _prompt()
    want = _greedy(model, prompt, 6)
    fast = _opt(model, (prompt,))
    assert fast.report.final["kept"] and fast.report.kept_passes, fast.report.final
    block_graph_calls.clear()
    torch.testing.assert_close(_greedy(fast, prompt, 6), want, rtol=0, atol=0)
    assert sum(block_graph_calls.values()) >= 6 * LAYERS  # the prefill and every decode call
    other = _prompt(length=PROMPT + 5, seed=4)
    torch.testing.assert_close(_greedy(fast, other, 4), _greedy(model, other, 4), rtol=0, atol=0)
    fast.restore()


def test_the_warm_up_call_one_token_shorter_keeps_a_static_caches_shapes():
    """generate passes a static cache's 4-d mask (queries x the cache's allocated length): one
    token shorter, the prefill has one query row fewer and the same key length; a decode call
    keeps its mask and its positions move back by one. A dynamic cache's 2-d mask loses its
    last position in every call (before, the static mask lost a key column instead and the
    layer's first trace failed on it, logged by Dynamo as an error)."""
    from rewriter.decide.generation import _fixed_length, _one_token_shorter
    ids, pos = torch.arange(8).view(1, 8), torch.arange(8).view(1, 8)
    static = {"input_ids": ids, "position_ids": pos, "attention_mask": torch.zeros(1, 1, 8, 11)}
    got = _one_token_shorter(static, True, 8, fixed=11)
    assert got["input_ids"].shape == (1, 7) and got["position_ids"].shape == (1, 7)
    assert got["attention_mask"].shape == (1, 1, 7, 11)
    decode = {"input_ids": ids[:, :1], "position_ids": torch.tensor([[8]]),
              "attention_mask": torch.zeros(1, 1, 1, 11)}
    got = _one_token_shorter(decode, False, 8, fixed=11)
    assert got["attention_mask"].shape == (1, 1, 1, 11) and got["position_ids"].item() == 7
    dynamic = {"input_ids": ids[:, :1], "attention_mask": torch.ones(1, 9)}
    assert _one_token_shorter(dynamic, False, 8)["attention_mask"].shape == (1, 8)
    from transformers.cache_utils import DynamicCache
    torch.manual_seed(0)
    model = _llama().eval()
    model.generation_config.cache_implementation = "static"
    g = Generation.greedy(model, (_prompt(),), {}, decode=2)
    assert _fixed_length(g.empty_cache) == PROMPT + 2 and _fixed_length(DynamicCache()) is None


def test_a_decode_call_is_one_new_token_against_a_cache_that_holds_tokens():
    """What CompiledForward compiles: read from shapes and the cache's own flags (no tensor
    value, which would wait for the device at every token)."""
    from transformers.cache_utils import DynamicCache

    from rewriter.decide.generation import is_decode_call
    one, many = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long)
    empty, filled = DynamicCache(), DynamicCache()
    filled.update(torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16), 0)
    assert is_decode_call({"input_ids": one, "past_key_values": filled})
    assert is_decode_call({"input_ids": one, "cache": filled})  # transformers 5's keyword
    assert not is_decode_call({"input_ids": many, "past_key_values": filled})  # a chunk of a prompt
    assert not is_decode_call({"input_ids": one, "past_key_values": empty})  # a one-token prompt
    assert not is_decode_call({"input_ids": one})  # no cache
    assert not is_decode_call({"input_ids": one, "past_key_values": None})
    assert is_decode_call({"inputs_embeds": torch.randn(1, 1, 16), "past_key_values": filled})
    assert not is_decode_call({"inputs_embeds": torch.randn(1, 7, 16), "past_key_values": filled})
    legacy = ((torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)),)  # a tuple per layer
    assert is_decode_call({"input_ids": one, "past_key_values": legacy})
    assert not is_decode_call({"input_ids": one, "past_key_values": ()})

    class Counted:  # a cache with no flag of its own: its length says
        def __init__(self, n):
            self.n = n

        def get_seq_length(self):
            return self.n
    assert is_decode_call({"input_ids": one, "past_key_values": Counted(3)})
    assert not is_decode_call({"input_ids": one, "past_key_values": Counted(0)})


@pytest.mark.parametrize("regional", [True, False])
def test_a_generations_compile_is_predicted_from_one_calls_graph_not_the_unrolled_step(regional):
    """What a generation compiles is the decode call's forward: the compile predicted before
    trying it is as large whatever the decode calls per step (the step unrolls the prefill and
    each decode call; predicting from all of them made a 9-call step's compile look 5x as
    large as it was, and a run that would repay it skipped it)."""
    torch.manual_seed(0)
    model = _llama().eval()
    slower = {name: 1.2 for name in rewriter.registered_passes()}
    nodes = {}
    for decode in (2, 8):
        fast = rewriter.optimize(model, (_prompt(),), clock=ControlledClock(slower), gate=QUICK,
                                 progress=False, profile=False, knowledge_base=False,
                                 compile="auto", steps=1, generate=decode, regional=regional)
        row = next(d for d in fast.report.decisions if d.pass_name == "compile")
        assert row.status == "not tried", row.reason  # steps=1: nothing repays a compile
        assert (fast.report.front_end == "regional") == regional
        nodes[decode] = row.measurement["nodes"]
        fast.restore()
    assert nodes[2] > 0 and abs(nodes[8] - nodes[2]) <= 0.35 * nodes[2], nodes


def test_a_generations_capture_is_dynamic_in_the_lengths_from_its_first_trace():
    """Every graph the capture hands over runs in the step (no graph static in a length, traced
    first and superseded: a Dynamo trace each, ~40% of the capture); the block has two graphs,
    the prefill's and the decode's; in what passes read, the sizes a weight fixes are ints and
    only the lengths stay symbolic."""
    from rewriter.capture.ir import tensor_info
    torch.manual_seed(0)
    model = _llama().eval()
    fast = _opt(model, (_prompt(),))
    cap = fast._outcome.capture
    assert all(s.calls > 0 for s in cap.slots), [(s.name, s.calls) for s in cap.slots]
    blocks = [s for s in cap.slots if s.block is not None]
    assert len(blocks) == 2, [s.name for s in blocks]
    for slot in blocks:
        infos = [i for n in slot.original.graph.nodes if (i := tensor_info(n)) is not None]
        # (batch, length, hidden): the hidden size an int (no comparison on a symbol: a guard)
        hidden = [i for i in infos if i.ndim == 3 and type(i.shape[0]) is int and i.shape[0] == 1]
        assert hidden and all(type(i.shape[-1]) is int for i in hidden)
        assert 64 in {i.shape[-1] for i in hidden}
        assert any(not isinstance(d, int) for i in infos for d in i.shape)  # a length
    fast.restore()


HEAD_SIZE = 16  # _llama: hidden 64, 4 heads


def test_a_prompt_as_long_as_the_head_size_is_still_a_length_the_graphs_are_dynamic_in():
    """Under dynamic=True, sizes of one value share one symbol by default (duck sizing): a
    prompt of 16 tokens against a head size of 16 fixed the prompt's length with the head
    size's, and the graphs were static in it. The decode graph compiled: one for every call,
    a second prompt length included; the captured block graphs: a new prompt length is served
    by them."""
    torch.manual_seed(0)
    model = _llama().eval()
    prompt = _prompt(length=HEAD_SIZE)
    slower = {name: 1.2 for name in rewriter.registered_passes()}
    backend = CountingBackend()
    fast = rewriter.optimize(model, (prompt,), clock=ControlledClock({**slower, "compile": 0.5}), gate=QUICK,
                             progress=False, profile=False, knowledge_base=False, compile=backend)
    assert next(d for d in fast.report.decisions if d.pass_name == "compile").kept
    other = _prompt(length=HEAD_SIZE + 3, seed=4)
    torch.testing.assert_close(_greedy(fast, other, 4), _greedy(model, other, 4), rtol=0, atol=0)
    assert backend.compiles == 1, backend.compiles
    fast.restore()
    fast = _opt(model, (prompt,))
    cap = fast._outcome.capture
    before = {s.name for s in cap.slots if s.block is not None}
    assert len(before) == 2, before
    torch.testing.assert_close(_greedy(fast, other, 4), _greedy(model, other, 4), rtol=0, atol=0)
    assert {s.name for s in cap.slots if s.block is not None} == before
    fast.restore()


def test_a_decode_call_with_the_tokens_passed_positionally_is_compiled_too():
    """A caller's own decode loop may pass the token ids positionally: bound to forward's
    names, the call is the decode call it is."""
    from rewriter.devices.executors import CompiledForward
    torch.manual_seed(0)
    model = _llama().eval()
    backend = CountingBackend()
    runner = CompiledForward(model, backend)
    with torch.no_grad():
        out = runner(_prompt(), use_cache=True)  # the prefill: uncompiled
        assert backend.runs == 0
        nxt = out.logits[:, -1:].argmax(-1)
        got = runner(nxt, past_key_values=out.past_key_values, use_cache=True)
        assert backend.runs == 1
        want = model(_prompt(), use_cache=True)
        want = model(nxt, past_key_values=want.past_key_values, use_cache=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)


def test_a_static_cache_holds_tokens_once_written():
    """transformers 5 allocates a static cache's layers at their first write: before the
    prefill it is empty (a one-token prompt is a prefill), after it a decode call."""
    from transformers.cache_utils import StaticCache

    from rewriter.decide.generation import is_decode_call
    torch.manual_seed(0)
    model = _llama().eval()
    cache = StaticCache(config=model.config, max_cache_len=32)
    one = torch.zeros(1, 1, dtype=torch.long)
    assert not is_decode_call({"input_ids": one, "past_key_values": cache})
    with torch.no_grad():
        model(_prompt(), past_key_values=cache, use_cache=True)
    assert is_decode_call({"input_ids": one, "past_key_values": cache})
