"""Inductor's and AOTAutograd's persistent caches, kept beside the knowledge base, so a second
process that compiles the same graphs loads them instead of compiling again (``python -m
benchmarks.compile_cache``: a first compiled step of 20.0 s cold, 2.5 s warm; llama, training,
regional compile, 2-core Xeon, torch 2.13; the regional compile's graphs are cacheable through
rewriter.devices.dynamo_inputs).

Inductor keeps its FX-graph and AOTAutograd caches under ``$TORCHINDUCTOR_CACHE_DIR``
(default: ``/tmp/torchinductor_<user>``, which a reboot or a fresh container empties). Before
its first compile, optimize() points it at ``<knowledge base folder>/inductor``::

    where = use_persistent_cache(kb.path)   # the folder now in use, or None

A folder the user set (``TORCHINDUCTOR_CACHE_DIR``) is left as it is. Inductor's own default
is not a choice: ``import torch._dynamo`` already writes it into the variable, so a value equal
to torch's default folder is replaced (Inductor reads the variable at each use, so later
compiles go to the new folder; what it compiled before stays loaded). Whether the caches are on is
torch's setting (``torch._inductor.config.fx_graph_cache``, ``torch._functorch.config.
enable_autograd_cache``: on by default in torch 2.13); optimize() does not change it.
"""
from __future__ import annotations

import os

ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_folder(knowledge_base_path: str | None) -> str | None:
    """The folder Inductor's caches use once :func:`use_persistent_cache` has run (None:
    Inductor's default, not yet chosen); changes nothing."""
    current = os.environ.get(ENV)
    if current and not _is_torch_default(current):
        return current
    if not knowledge_base_path:
        return current or None
    root = os.path.dirname(os.path.abspath(os.path.expanduser(knowledge_base_path)))
    return os.path.join(root, "inductor")


def use_persistent_cache(knowledge_base_path: str | None) -> str | None:
    """Point Inductor's persistent caches beside the knowledge base unless a folder is set
    already (called right before a compile); return the folder in use."""
    folder = cache_folder(knowledge_base_path)
    if folder is not None:
        os.environ[ENV] = folder
    return folder


def is_warm(folder: str | None) -> bool:
    """Whether ``folder`` holds compiled artefacts (an earlier process compiled into it)."""
    return bool(folder) and os.path.isdir(folder) and any(os.scandir(folder))


def _is_torch_default(folder: str) -> bool:
    """Whether ``folder`` is the one Inductor picks when nobody chose (``/tmp/torchinductor_<user>``)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: take the folder for the user's choice
        return False
    return os.path.abspath(folder) == os.path.abspath(default_cache_dir())
