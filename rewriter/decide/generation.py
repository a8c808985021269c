"""The generation workload: what an inference step is for a model that generates with a KV cache.

A causal language model serves ``generate()``: one prefill of the prompt, then one decode call
per new token, each a single token against a growing cache. Timing the prefill alone decides
for a call that runs once per generation, and misses the one that runs per token. So for such a
model optimize()'s inference step is the prefill of the example prompt and ``decode`` decode
calls, and the gate, the verification and the capture see both signatures::

    gen = Generation.greedy(model, args, kwargs, decode=8)   # generate()'s own calls, recorded
    outputs = gen.run(model)                                 # logits of the 1 + 8 calls

The calls are recorded from the model's own greedy ``generate()``, argument for argument (the
keywords generate passes, its cache class, its masks and positions), so what is measured,
verified and compiled is called exactly as generate() will call it later. They are replayed
teacher-forced: each decode call feeds the token the original model picked, fixed once, so
the original and a rewritten model run the very same calls and their logits compare call by
call (a near-tie in one argmax cannot send two runs down different sequences). Every step
starts from an empty cache of generate's own kind, so each step is the same work.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from rewriter.decide.state import preserved_state

# Decode calls per step when optimize(generate=...) does not say: enough that the decode graph
# (a signature of its own, dynamic in the cache length from its second call) dominates the step.
DEFAULT_DECODE_CALLS = 8
# Example inputs a generate() call takes on: the prompt and its mask.
_CARRIED = frozenset({"input_ids", "attention_mask", "use_cache"})
_CACHE_ARGS = ("cache", "past_key_values")  # what forward calls the KV cache (transformers 5; 4)


class GenerationUnavailable(ValueError):
    """The model, or its example inputs, have no decode call this workload can build."""


@dataclass(frozen=True)
class Generation:
    """The prefill and decode calls the model's greedy ``generate()`` made, to replay."""

    calls: tuple[dict, ...]  # keyword arguments of each call, the cache left out
    cache_arg: str | None  # the keyword the cache goes in (None: the model builds its own)
    empty_cache: Any  # the cache generate() handed the prefill, before it was written (or None)

    @property
    def decode_calls(self) -> int:
        return len(self.calls) - 1

    @property
    def tokens(self) -> torch.Tensor:
        """(batch, decode calls): the token each decode call feeds."""
        return torch.cat([c["input_ids"] for c in self.calls[1:]], dim=1)

    def describe(self) -> str:
        ids = self.calls[0]["input_ids"]
        return (f"generate: a prefill of {ids.shape[0]}x{ids.shape[1]} tokens and "
                f"{self.decode_calls} decode calls with the KV cache, as generate() calls the "
                "model (the original model's greedy tokens, fed to every variant)")

    def run(self, run: Callable[..., Any]) -> tuple:
        """The prefill and the decode calls through ``run`` (the model, or what stands in for
        it); their logits, in order."""
        return self._replay(run, self.calls)

    def warm_up(self, run: Callable[..., Any]) -> None:
        """Calls that show Dynamo each shape class before the run that counts: a prompt one
        token shorter, so the prefill graph it hands over at the real prompt is dynamic in the
        length (a new prompt length is then served as it is), and two decode calls, so the
        decode graph is dynamic in the cache length from then on. The graphs these calls leave
        behind (static in a length) are superseded: the counted run never reaches them."""
        length = self.calls[0]["input_ids"].shape[1]
        if length >= 2:
            try:
                fixed = _fixed_length(self.empty_cache)
                self._replay(run, [_one_token_shorter(c, i == 0, length, fixed)
                                   for i, c in enumerate(self.calls[:3])])
                return
            except Exception:  # a model that insists on its prompt's length: no dynamic prefill
                pass
        self._replay(run, self.calls[:3])

    def _replay(self, run: Callable[..., Any], calls: Any) -> tuple:
        cache = copy.deepcopy(self.empty_cache)
        outputs = []
        for call in calls:
            kwargs = dict(call)
            if self.cache_arg is not None:
                kwargs[self.cache_arg] = cache
            out = run(**kwargs)
            outputs.append(_logits(out))
            cache = _cache_of(out)
        return tuple(outputs)

    @classmethod
    def greedy(cls, model: nn.Module, args: tuple, kwargs: dict, decode: int) -> "Generation":
        """Record the calls of the model's greedy ``generate()`` of ``decode`` new tokens after
        the example prompt (without gradients; the caller preserves the RNG). Raises
        GenerationUnavailable when there is no decode call to record: no generate(), no prompt
        of token ids, an argument generate() does not take on, no position left for a new
        token, no cache returned."""
        if not callable(getattr(model, "generate", None)):
            raise GenerationUnavailable(f"{type(model).__name__} has no generate()")
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            # generate() runs the encoder once outside forward: a replay of forward's calls
            # would never run the encoder's rewrites
            raise GenerationUnavailable("an encoder-decoder model's generate() is not recorded here")
        ids = _check_prompt(args, kwargs)
        room = _positions(model) - ids.shape[1]
        if room < 1:
            raise GenerationUnavailable(f"the prompt ({ids.shape[1]} tokens) fills the model's "
                                        "positions: no room for a decode call")
        decode = min(decode, room)
        calls: list[dict] = []
        empty: list[Any] = []
        forward = model.forward

        # generate() reads forward's signature to choose what to pass (logits_to_keep, ...):
        # the recorder shows it the real one
        @functools.wraps(forward)
        def recording(*a: Any, **kw: Any) -> Any:
            if a:
                raise GenerationUnavailable("generate() passed the model positional arguments")
            name = next((n for n in _CACHE_ARGS if n in kw), None)
            if not calls:
                empty.append((name, copy.deepcopy(kw.get(name)) if name else None))
            calls.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in kw.items() if k != name})
            out = forward(**kw)
            if len(calls) == 1:
                _cache_of(out)  # no cache (config.use_cache=False): no decode call to replay
            return out
        given = {k: v for k, v in kwargs.items() if k != "input_ids"}
        with forward_in_place(model, recording), torch.no_grad():
            # greedy, one beam, whatever the model's generation_config says
            model.generate(ids, max_new_tokens=decode + 1, min_new_tokens=decode + 1,
                           do_sample=False, num_beams=1, **given)
        if len(calls) < 2:
            raise GenerationUnavailable("generate() made no decode call")
        (name, cache), = empty
        return cls(tuple(calls[:decode + 1]), name, cache)


@contextlib.contextmanager
def forward_in_place(model: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``forward`` as the instance's forward during the body (what ``model(...)`` and so
    ``generate()`` call); the instance is as it was afterwards, whatever happened."""
    d = model.__dict__
    had, old = "forward" in d, d.get("forward")
    d["forward"] = forward
    try:
        yield
    finally:
        if had:
            d["forward"] = old
        else:
            d.pop("forward", None)


def is_decode_call(kwargs: dict) -> bool:
    """Whether a forward call is a decode step: one new token (``input_ids`` or
    ``inputs_embeds`` one position long) against a KV cache that already holds tokens. Read from
    the arguments' structure (shapes, the cache's own flags, a length it keeps as an int), not
    from a tensor on an accelerator, which would wait for the device at every token. A prompt
    of one token against an empty cache is a prefill (transformers 5 allocates a cache's layers
    at their first write, static ones too); a cache allocated before the prefill
    (``early_initialization``) reads as holding tokens, so a one-token prompt against it counts
    as a decode call (compiled: the same numbers). A cache that keeps its length as a tensor on
    an accelerator and has no flag (transformers 4's StaticCache on a GPU) is not read: its
    calls run the forward uncompiled."""
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        one = ids.shape[-1] == 1
    elif isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        one = embeds.shape[-2] == 1
    else:
        return False
    cache = next((kwargs[n] for n in _CACHE_ARGS if kwargs.get(n) is not None), None)
    return one and cache is not None and _holds_tokens(cache)


def _holds_tokens(cache: Any) -> bool:
    if isinstance(cache, (tuple, list)):  # the legacy form: a tuple per layer
        return len(cache) > 0
    flag = getattr(cache, "is_initialized", None)  # transformers 5's caches, allocated at the first write
    if isinstance(flag, bool):
        return flag
    length = cache.get_seq_length() if callable(getattr(cache, "get_seq_length", None)) else None
    if isinstance(length, torch.Tensor) and length.numel() == 1 and length.device.type == "cpu":
        length = int(length)  # a host tensor: no device to wait for
    return isinstance(length, int) and length > 0


def can_generate(model: nn.Module) -> bool:
    """Whether the model says it generates (transformers' ``GenerationMixin.can_generate``)."""
    check = getattr(model, "can_generate", None)
    try:
        return bool(callable(check) and check())
    except Exception:
        return False


def _prompt(args: tuple, kwargs: dict) -> Any:
    return kwargs.get("input_ids", args[0] if args else None)


def _check_prompt(args: tuple, kwargs: dict) -> torch.Tensor:
    ids = _prompt(args, kwargs)
    if len(args) > 1 or (args and "input_ids" in kwargs):
        raise GenerationUnavailable("the example inputs pass more than the token ids positionally")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
        raise GenerationUnavailable("the example inputs have no (batch, length) tensor of token ids")
    other = sorted(set(kwargs) - _CARRIED)
    if other:
        raise GenerationUnavailable(f"the example inputs pass {', '.join(other)}, which "
                                    "generate() is not given here (input_ids, attention_mask and "
                                    "use_cache are)")
    if kwargs.get("use_cache") is False:
        raise GenerationUnavailable("the example inputs pass use_cache=False")
    return ids


def _positions(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return 2**31


# A decode call's positions: one less when the prompt was one token shorter (a static cache
# writes at ``cache_position``; left as they were, they point one past what the cache holds)
_POSITIONS = ("cache_position", "position_ids")


def _fixed_length(cache: Any) -> int | None:
    """The length a cache is allocated to (transformers' static cache), or None (it grows)."""
    lengths = {getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", None) or ()}
    return lengths.pop() if len(lengths) == 1 and None not in lengths else None


def _one_token_shorter(call: dict, prefill: bool, length: int, fixed: int | None = None) -> dict:
    """A call as it would be with a prompt one token shorter: in the prefill every tensor as
    long as the prompt in its last dimension (ids, mask, positions) loses its last position;
    later, the attention mask does, and the positions are one less. A 4-d mask (what generate
    passes with a static cache) loses its last query row in the prefill, and keeps its key
    length where that is the cache's ``fixed`` length."""
    def shorter(k: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        if k == "attention_mask" and v.dim() == 4:
            v = v[..., :-1, :] if prefill else v
            return v if v.shape[-1] == fixed else v[..., :-1]
        if (prefill and v.shape[-1] == length) or k == "attention_mask":
            return v[..., :-1]
        if not prefill and k in _POSITIONS and not v.is_floating_point():
            return v - 1
        return v
    return {k: shorter(k, v) for k, v in call.items()}


def _cache_of(out: Any) -> Any:
    for name in _CACHE_ARGS:
        cache = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if cache is not None:
            return cache
    raise GenerationUnavailable("the model's output carries no KV cache")


def _logits(out: Any) -> torch.Tensor:
    logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise GenerationUnavailable("the model's output has no (batch, length, vocabulary) logits")
    return logits


def generation_for(model: nn.Module, args: tuple, kwargs: dict, generate: bool | int | str,
                   rng_states: list | None = None) -> tuple[Generation | None, str]:
    """The generation workload optimize(generate=...) asks for, and a note when "auto" found
    none. ``generate``: "auto" (a model that says it generates: the default number of decode
    calls), True (the same, and an error when there is none), an int (that many decode calls),
    False (one call). Recording runs the model without gradients, and its state (the RNG
    included, ``rng_states``: the device's, rewriter.devices.backends) is put back after."""
    if generate is False or (generate == "auto" and not can_generate(model)):
        return None, ""
    calls = DEFAULT_DECODE_CALLS if isinstance(generate, (bool, str)) else generate
    try:
        with preserved_state(model, None, rng_states):
            return Generation.greedy(model, args, kwargs, calls), ""
    except Exception as e:  # GenerationUnavailable, or a model that fails a decode call
        why = str(e) if isinstance(e, GenerationUnavailable) else f"a decode call raised {type(e).__name__}: {e}"
        if generate == "auto":
            return None, f"generate='auto': the step is one call ({why})"
        raise ValueError(f"optimize(generate={generate!r}): {why}") from e


def check_generate(generate: Any) -> bool | int | str:
    """``generate`` as optimize() takes it, or a ValueError naming what is wrong."""
    if isinstance(generate, bool) or (isinstance(generate, str) and generate == "auto"):
        return generate
    if isinstance(generate, int) and generate >= 1:
        return generate
    raise ValueError(f"generate must be 'auto', True, False or a number of decode calls >= 1, "
                     f"got {generate!r}")
