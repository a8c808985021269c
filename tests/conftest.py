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
