"""The knowledge base: decisions per site signature, as JSON, reused across runs and models.

A region measured once on this device (same pass and version, same structure, same boundary
shapes, dtypes and strides, same mode, same torch/torch_npu versions) need not be measured
again: a 32-layer model costs one layer, and a second model that shares a region shape with an
earlier one reuses the measurement. This is the tuning guide's AOE step, "generate a knowledge
base, reuse it automatically", for rewrites::

    kb = KnowledgeBase.at("~/.cache/rewriter/knowledge_base.json")
    entry = kb.get(key)              # None, or {"kept": ..., "speedup": ..., ...}
    kb.put(key, {...}); kb.save()

The fused optimizer's own-step timing is stored the same way, under a signature of the step
(rewriter.decide.optimizer_gate.step_signature), and so is a pass decided on the whole step
(to_channels_last, cast_to_half, a change that is not local), under a signature of exactly that
step: the kept and candidate graphs, the model's tensor shapes, the inputs, the optimizer
(``Run._step_key``; time decisions only, a memory decision measures its peaks every run), and
the step check of a composed step that showed no regression (``Run.confirmation_key``, its
samples; rewriter.decide.confirm). The device part of every key is ``Backend.knowledge_key()``: the
torch and torch_npu versions, and the machine (CPU model and thread count, GPU or NPU name).
A region's key also carries how regions are timed (``site_gate.REGION_TIMING``), a whole-step
figure's how steps are timed (``Job.step_knowledge_key``), the optimizer's how its own step is
timed (``optimizer_gate.OPTIMIZER_TIMING``): figures measured another way are measured again,
not replayed.
Only completed timings are stored (kept, slower, below the margin, within noise); a comparison
a busy machine spoiled, or one the time budget cut short, is not. A region too cheap to compare
is stored as its original's time alone (``original_ms``), judged against each run's own step.
Verification is never taken from here: a signature replayed as kept is verified on the run's
own values; one replayed as rejected is not run at all, so there is nothing to verify
(except under objective="memory" in training, where what it holds for backward may keep it).
The default location is ``$REWRITER_KNOWLEDGE_BASE`` (a file path, or ``off``), else
``$XDG_CACHE_HOME/rewriter/knowledge_base.json`` (``~/.cache`` when unset).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

KB_FORMAT = "rewriter-knowledge/1"
_OFF = {"", "0", "off", "false", "no", "none"}


def default_path() -> str | None:
    """Where the knowledge base lives unless optimize(knowledge_base=...) says otherwise."""
    env = os.environ.get("REWRITER_KNOWLEDGE_BASE")
    if env is not None:
        return None if env.strip().lower() in _OFF else os.path.expanduser(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "rewriter", "knowledge_base.json")


def entry_key(signature: str, versions: dict[str, str]) -> str:
    """The signature and the software versions it was measured with, as one key."""
    text = signature + "\n" + json.dumps(versions, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class KnowledgeBase:
    """Decisions by key; ``path=None`` keeps them in memory for this run only."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self._new: dict[str, dict[str, Any]] = {}
        if path is not None:
            self.entries = self._read(path)

    @classmethod
    def at(cls, where: "str | os.PathLike | bool | None") -> "KnowledgeBase":
        """``optimize(knowledge_base=...)``: a path, True/None (the default place), False (off)."""
        if where is False:
            return cls(None)
        if where is None or where is True:
            return cls(default_path())
        path = os.path.expanduser(os.fspath(where))
        if os.path.isdir(path):
            path = os.path.join(path, "knowledge_base.json")
        return cls(path)

    @staticmethod
    def _read(path: str) -> dict[str, dict[str, Any]]:
        if not os.path.exists(path):
            return {}
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            log.warning("rewriter: knowledge base %s is unreadable (%s); starting a new one", path, e)
            return {}
        if not isinstance(data, dict) or data.get("format") != KB_FORMAT \
                or not isinstance(data.get("entries"), dict):
            log.warning("rewriter: %s is not a rewriter knowledge base; not used", path)
            return {}
        return data["entries"]

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        entry = dict(entry, recorded=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.entries[key] = entry
        self._new[key] = entry

    def save(self) -> None:
        """Merge this run's entries into the file (another run may have written meanwhile);
        written whole, then renamed, so a reader never sees half a file."""
        if self.path is None or not self._new:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            merged = self._read(self.path)
            merged.update(self._new)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"format": KB_FORMAT, "entries": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            self._new.clear()
        except OSError as e:  # a read-only home must not cost the user the optimization
            log.warning("rewriter: could not write the knowledge base %s (%s)", self.path, e)
