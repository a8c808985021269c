"""Plans: the kept rewrites of one optimize() run, as JSON, replayable without measuring.

A plan is valid for the graphs, the model's parameter and buffer shapes, input shapes, device,
machine (CPU model and threads, GPU or NPU name) and versions it was made on; its fingerprint records them and
:func:`fingerprint_mismatch` names what differs (ranks replaying rank 0's plan ignore the
machine: every rank must run the same graph)::

    model = rewriter.optimize(model, example_inputs=(x,), plan="out/plan.json")
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable

import torch

from rewriter.errors import PlanError

PLAN_FORMAT = "rewriter-plan/1"


def input_signature(args: tuple, kwargs: dict) -> list[str]:
    def describe(name: str, v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{name}:{v.dtype}{list(v.shape)}"
        return f"{name}:{type(v).__name__}"
    return ([describe(str(i), a) for i, a in enumerate(args)]
            + [describe(k, v) for k, v in sorted(kwargs.items())])


def tensor_hash(model: torch.nn.Module) -> str:
    """The model's parameters and buffers (names, shapes, dtypes), hashed: what the graphs'
    op names leave out (two models with one op sequence and other widths, or a bias more)."""
    tensors = [[n, list(t.shape), str(t.dtype)] for n, t in
               list(model.named_parameters()) + list(model.named_buffers())]
    return hashlib.sha256(json.dumps(tensors).encode()).hexdigest()[:16]


def graph_hash(signatures: Iterable[list[str]]) -> str:
    h = hashlib.sha256()
    for sig in signatures:
        h.update("\n".join(sig).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def make_plan(fingerprint: dict, kept: list[str], decisions: list[dict],
              optimizer: str | None = None, kept_sites: dict[str, dict] | None = None,
              compile: dict | None = None) -> dict:
    """``kept``: graph passes to apply in order; ``optimizer``: the fused optimizer form kept;
    ``kept_sites``: per pass, the region signatures (and shape-free structures) it was kept
    for (``None`` signatures: every site). A plan without it applies every site.
    ``compile``: the graph compiler's decision, ``{"executor": name, "kept": bool}`` (None:
    not tried); a replay compiles with it without measuring."""
    return {"format": PLAN_FORMAT, "fingerprint": fingerprint, "kept_passes": kept,
            "kept_sites": kept_sites or {}, "optimizer": optimizer, "decisions": decisions,
            "compile": compile}


def load_plan(source: str | os.PathLike | dict) -> dict:
    """Read and check a plan; a corrupt or foreign file raises PlanError naming it."""
    if isinstance(source, dict):
        plan, where = source, "plan dict"
    else:
        where = os.fspath(source)
        try:
            with open(where) as f:
                plan = json.load(f)
        except FileNotFoundError as e:
            raise PlanError(f"plan file {where} does not exist") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"plan file {where} is not valid JSON (corrupt or truncated): {e}") from e
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise PlanError(f"{where} is not a rewriter plan (expected format {PLAN_FORMAT!r})")
    kept = plan.get("kept_passes")
    if not isinstance(kept, list) or not all(isinstance(k, str) for k in kept) \
            or not isinstance(plan.get("fingerprint"), dict):
        raise PlanError(f"{where} is missing 'kept_passes' (list of names) or 'fingerprint'")
    return plan


def fingerprint_mismatch(expected: dict, actual: dict) -> list[str]:
    """Names of fingerprint fields that differ, with both values."""
    return [f"{k}: plan has {expected.get(k)!r}, this run has {actual.get(k)!r}"
            for k in sorted(set(expected) | set(actual)) if expected.get(k) != actual.get(k)]


def _cache_path(cache_dir: str | os.PathLike, fingerprint: dict) -> str:
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return os.path.join(cache_dir, f"plan-{key}.json")


def cached_plan(cache_dir: str | os.PathLike, fingerprint: dict) -> dict | None:
    """The plan decided before for exactly this fingerprint, or None (a corrupt entry is ignored)."""
    path = _cache_path(cache_dir, fingerprint)
    if not os.path.exists(path):
        return None
    try:
        plan = load_plan(path)
    except PlanError:
        return None
    return plan if plan["fingerprint"] == fingerprint else None


def cache_plan(cache_dir: str | os.PathLike, fingerprint: dict, plan: dict) -> None:
    """Store ``plan`` under its fingerprint; written whole then renamed, so readers never see half."""
    os.makedirs(cache_dir, exist_ok=True)
    path = _cache_path(cache_dir, fingerprint)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(plan, f, indent=2)
    os.replace(tmp, path)
