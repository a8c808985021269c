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


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """Put the reference shim in sys.modules as ``torch_npu`` for the duration of a test."""
    module = npu_shim.as_module()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.fixture
def seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def private_peaks_cache(tmp_path_factory):
    """Peaks measured for the roofline are cached per machine; tests keep theirs out of ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("REWRITER_CACHE_DIR", str(tmp_path_factory.mktemp("rewriter-cache")))
    yield
    mp.undo()
