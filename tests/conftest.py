import sys

import pytest
import torch

from tests import npu_shim


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: Dynamo's per-code-object cache would otherwise fill up."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def private_knowledge_base(tmp_path, monkeypatch):
    """Each test starts with an empty knowledge base of its own (never the user's ~/.cache)."""
    path = tmp_path / "knowledge_base.json"
    monkeypatch.setenv("REWRITER_KNOWLEDGE_BASE", str(path))
    return path


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """Put the reference shim in sys.modules as ``torch_npu`` for the duration of a test."""
    module = npu_shim.as_module()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.fixture
def seeded():
    torch.manual_seed(0)


@pytest.fixture
def emulate(monkeypatch):
    """``emulate(chip, version)``: put the strict shim in sys.modules as ``torch_npu``,
    emulating that SoC name and torch_npu version; returns the module."""
    def put(chip=npu_shim.A2_CHIP, version=npu_shim.NEWEST_VERSION):
        module = npu_shim.as_module(chip, version)
        monkeypatch.setitem(sys.modules, "torch_npu", module)
        return module
    return put


# The chips and versions every NPU form is checked under: an Atlas A2 training part and an
# Atlas 300I/310P part at the oldest torch_npu the project claims, and A2 at the newest.
NPU_TARGETS = [(npu_shim.A2_CHIP, npu_shim.OLDEST_VERSION), (npu_shim.P310_CHIP, npu_shim.OLDEST_VERSION),
               (npu_shim.A2_CHIP, npu_shim.NEWEST_VERSION)]


@pytest.fixture(params=NPU_TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def npu_target(request, emulate):
    """The strict shim emulating each of NPU_TARGETS in turn; yields (module, chip)."""
    chip, version = request.param
    return emulate(chip, version), chip


@pytest.fixture(autouse=True, scope="session")
def private_caches(tmp_path_factory):
    """Peaks measured for the roofline are cached per machine, decisions in a knowledge base;
    tests keep theirs out of ~/.cache. (A module-scoped fixture runs before the per-test
    knowledge base is set: it gets this session's.)"""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("rewriter-cache")
    mp.setenv("REWRITER_CACHE_DIR", str(cache))
    mp.setenv("REWRITER_KNOWLEDGE_BASE", str(cache / "knowledge_base.json"))
    yield
    mp.undo()
