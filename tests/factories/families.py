"""Tiny transformers models of ten families, eager attention, random weights (nothing downloaded).

For the reach tables: every family's modeling code writes attention, norms, activations and
MLPs its own way; a test counts the sites a pass finds in each against the count read from
that modeling code::

    model, inputs = build("gemma")
    sites = family_sites("gemma", "fuse_rms_norm")          # captured once per family, Dynamo
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

LAYERS, SEQ, VOCAB, BATCH = 2, 16, 128, 2
_COMMON = dict(vocab_size=VOCAB, attn_implementation="eager")


def _decoder(cls_name: str, cfg_name: str, **extra) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers
        cfg = getattr(transformers, cfg_name)(
            num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            max_position_embeddings=64, **_COMMON, **extra)
        return getattr(transformers, cls_name)(cfg)
    return make


def _gpt2() -> nn.Module:
    import transformers
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, n_positions=64,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **_COMMON)
    return transformers.GPT2LMHeadModel(cfg)


def _gptj() -> nn.Module:
    import transformers
    cfg = transformers.GPTJConfig(n_layer=LAYERS, n_embd=64, n_head=4, rotary_dim=8, n_positions=64,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **_COMMON)
    return transformers.GPTJForCausalLM(cfg)


def _bert() -> nn.Module:
    import transformers
    cfg = transformers.BertConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **_COMMON)
    return transformers.BertForMaskedLM(cfg)


def _falcon() -> nn.Module:
    import transformers
    cfg = transformers.FalconConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                    new_decoder_architecture=False, multi_query=True,
                                    hidden_dropout=0.0, attention_dropout=0.0, **_COMMON)
    return transformers.FalconForCausalLM(cfg)


def _bloom() -> nn.Module:
    import transformers
    cfg = transformers.BloomConfig(n_layer=LAYERS, hidden_size=64, n_head=4, hidden_dropout=0.0,
                                   attention_dropout=0.0, **_COMMON)
    return transformers.BloomForCausalLM(cfg)


def _t5() -> nn.Module:
    import transformers
    cfg = transformers.T5Config(num_layers=LAYERS, num_decoder_layers=LAYERS, d_model=64, d_kv=16,
                                d_ff=128, num_heads=4, dropout_rate=0.0,
                                feed_forward_proj="gated-gelu", **_COMMON)
    return transformers.T5ForConditionalGeneration(cfg)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": _decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2),
    "mistral": _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2),
    "qwen3": _decoder("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=16),
    "gemma": _decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=16),
    "falcon": _falcon,
    "bloom": _bloom,
    "gptj": _gptj,
    "gpt2": _gpt2,
    "bert": _bert,
    "t5": _t5,
}


def inputs(family: str, labels: bool = False) -> dict[str, torch.Tensor]:
    """Fixed token ids (and labels) shaped for ``family``; T5 also gets decoder inputs."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    out = {"input_ids": ids}
    if family == "t5":
        out["decoder_input_ids"] = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    if labels:
        out["labels"] = out.get("decoder_input_ids", ids) if family != "t5" else ids
    return out


def build(family: str, *, training: bool = False, labels: bool = False) -> tuple[nn.Module, dict]:
    """The tiny model of ``family`` (seeded) in train or eval mode, and its inputs."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.train(training)
    return model, inputs(family, labels)


@functools.lru_cache(maxsize=None)
def family_capture(family: str, training: bool = False):
    """``family`` captured with Dynamo (as optimize() does), once per process: (capture, model, inputs).

    Treat it as read-only: count with ``family_sites``; to rewrite, capture afresh with
    ``tests.helpers.rewrite`` (its graphs are changed in place).
    """
    from rewriter.capture.front_ends import capture
    torch._dynamo.reset()  # many captures in one process would hit Dynamo's recompile limit
    model, kw = build(family, training=training)
    cap = capture(model, (), kw, "dynamo")
    with torch.enable_grad() if training else torch.no_grad():
        cap(**kw)  # Dynamo hands over its graphs at the first call
    return cap, model, kw


def family_sites(family: str, pass_name: str, *, training: bool = False, backend=None) -> list:
    """The sites ``pass_name`` finds in every graph of ``family`` (nothing is rewritten)."""
    from rewriter.capture.ir import copy_graph_module
    from rewriter.devices.backends import CpuBackend
    from rewriter.pass_api import PassContext, registered_passes
    cap, _, _ = family_capture(family, training)
    p = registered_passes()[pass_name]
    ctx = PassContext(backend or CpuBackend(), training)
    return [site for slot in cap.slots for site in p.find(copy_graph_module(slot.kept), ctx)]
