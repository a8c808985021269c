"""The generation workload: what an inference step is for a model that generates with a KV cache.

A causal language model serves ``generate()``: one prefill of the prompt, then one decode call
per new token, each a single token against a growing cache. Timing the prefill alone decides
for a call that runs once per generation, and misses the one that runs per token. So for such a
model optimize()'s inference step is a prefill of the example prompt followed by ``decode``
decode calls, and the gate, the verification and the capture see both signatures::

    gen = Generation.greedy(model, args, kwargs, decode=8)   # the original model's own tokens
    outputs = gen.run(model, args, kwargs)                   # logits of the 1 + 8 calls

The decode calls are teacher-forced: the tokens fed are the ones the original model chose
greedily, fixed once, so the original and a rewritten model run the very same calls and their
logits compare call by call (a near-tie in one argmax cannot send two runs down different
sequences). A fresh cache is built by the prefill of every step, so each step is the same work.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

# Decode calls per step when optimize(generate=...) does not say: enough that the decode graph
# (a signature of its own, dynamic in the cache length from its second call) dominates the step.
DEFAULT_DECODE_CALLS = 8
# Prefill arguments the decode calls can carry on (extended by the new tokens); any other
# argument has no decode form known here.
_CARRIED = frozenset({"input_ids", "attention_mask", "use_cache"})


class GenerationUnavailable(ValueError):
    """The model, or its example inputs, have no decode call this workload can build."""


@dataclass(frozen=True)
class Generation:
    """A prefill of the example prompt and ``len(tokens[0])`` teacher-forced decode calls."""

    tokens: torch.Tensor  # (batch, decode calls): the token each decode call feeds
    cache_arg: str = "past_key_values"  # what the model's forward calls its cache ("cache" in newer transformers)

    @property
    def decode_calls(self) -> int:
        return int(self.tokens.shape[1])

    def describe(self, args: tuple, kwargs: dict) -> str:
        ids = _prompt(args, kwargs)
        return (f"generate: a prefill of {ids.shape[0]}x{ids.shape[1]} tokens and "
                f"{self.decode_calls} decode calls with the KV cache (the original model's greedy "
                "tokens, fed to every variant)")

    def run(self, run: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
        """The prefill and the decode calls through ``run`` (the model, or what stands in for
        it); their logits, in order."""
        return self._calls(run, args, kwargs, self.decode_calls)

    def warm_up(self, run: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Calls that show Dynamo each shape class before the run that counts: a prompt one
        token shorter, so the prefill graph it hands over at the real prompt is dynamic in the
        length (a new prompt length is then served as it is), and two decode calls, so the
        decode graph is dynamic in the cache length from then on. The graphs these calls leave
        behind (static in a length) are superseded: the counted run never reaches them."""
        ids = _prompt(args, kwargs)
        if ids.shape[1] >= 2:
            shorter = {k: (v[:, :-1] if k in ("input_ids", "attention_mask") else v) for k, v in kwargs.items()}
            self._calls(run, (ids[:, :-1],) if args else (), shorter, min(2, self.decode_calls))
        else:
            self._calls(run, args, kwargs, min(2, self.decode_calls))

    def _calls(self, run: Callable[..., Any], args: tuple, kwargs: dict, decode: int) -> tuple:
        out = run(*args, **kwargs)
        outputs = [_logits(out)]
        mask = kwargs.get("attention_mask")
        for i in range(decode):
            mask = _longer(mask)
            out = run(**_decode_kwargs(self.cache_arg, self.tokens[:, i:i + 1], out, mask))
            outputs.append(_logits(out))
        return tuple(outputs)

    @classmethod
    def greedy(cls, model: nn.Module, args: tuple, kwargs: dict, decode: int) -> "Generation":
        """The tokens the model itself picks greedily after the prompt (run without gradients;
        the caller preserves the RNG). Raises GenerationUnavailable when there is no decode call
        to build: no prompt of token ids, an argument with no decode form, no cache returned,
        no position left for a new token."""
        ids = _check_prompt(args, kwargs)
        room = _positions(model) - ids.shape[1]
        if room < 1:
            raise GenerationUnavailable(f"the prompt ({ids.shape[1]} tokens) fills the model's "
                                        "positions: no room for a decode call")
        decode = min(decode, room)
        name = _cache_arg(model)
        mask = kwargs.get("attention_mask")
        tokens: list[torch.Tensor] = []
        with torch.no_grad():
            out = model(*args, **kwargs)
            for _ in range(decode):
                nxt = _logits(out)[:, -1, :].argmax(dim=-1, keepdim=True)
                tokens.append(nxt)
                if len(tokens) < decode:
                    mask = _longer(mask)
                    out = model(**_decode_kwargs(name, nxt, out, mask))
        return cls(torch.cat(tokens, dim=1), name)


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
        raise GenerationUnavailable(f"the example inputs pass {', '.join(other)}, which a decode "
                                    "call has no form for here (input_ids, attention_mask and "
                                    "use_cache are carried on)")
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


def _cache_arg(model: nn.Module) -> str:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _longer(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask with one more attended position (the new token's)."""
    return None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)


def _decode_kwargs(cache_arg: str, token: torch.Tensor, out: Any, mask: torch.Tensor | None) -> dict:
    step = {"input_ids": token, cache_arg: _cache_of(out), "use_cache": True}
    if mask is not None:
        step["attention_mask"] = mask
    return step


def _cache_of(out: Any) -> Any:
    for name in ("cache", "past_key_values"):
        cache = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if cache is not None:
            return cache
    raise GenerationUnavailable("the model's output carries no KV cache")


def _logits(out: Any) -> torch.Tensor:
    logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise GenerationUnavailable("the model's output has no (batch, length, vocabulary) logits")
    return logits


def generation_for(model: nn.Module, args: tuple, kwargs: dict, generate: bool | int | str) -> \
        tuple[Generation | None, str]:
    """The generation workload optimize(generate=...) asks for, and a note when "auto" found
    none. ``generate``: "auto" (a model that says it generates and returns a KV cache: the
    default number of decode calls), True (the same, and an error when there is none), an int
    (that many decode calls), False (one call). Runs the model without gradients; the caller
    keeps its state (RNG included)."""
    if generate is False or (generate == "auto" and not can_generate(model)):
        return None, ""
    calls = DEFAULT_DECODE_CALLS if isinstance(generate, (bool, str)) else generate
    try:
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
