"""The trainer integrations are optional: importing rewriter never needs transformers,
accelerate or Lightning, and an integration used without its framework names the extra."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from rewriter.integrations._intercept import check_options

BLOCKED = ("transformers", "accelerate", "lightning", "pytorch_lightning")


def test_rewriter_imports_without_the_frameworks_and_each_integration_names_its_extra():
    script = textwrap.dedent(f"""
        import importlib.abc, json, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError(f"blocked: {{name}}")
        sys.meta_path.insert(0, Block())
        import rewriter
        result = {{"rewriter": rewriter.__version__,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})}}
        for name in ("transformers", "lightning"):
            try:
                importlib = __import__("importlib")
                importlib.import_module("rewriter.integrations." + name)
                result[name] = "imported"
            except ImportError as e:
                result[name] = str(e)
        print(json.dumps(result))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    assert "pip install 'rewriter[hf]'" in result["transformers"]
    assert "pip install 'rewriter[lightning]'" in result["lightning"]


def test_options_are_checked_against_optimize():
    check_options({"dtype": None, "passes": ["fuse_attention"], "clock": None})
    with pytest.raises(TypeError, match="unknown optimize\\(\\) option 'dtyp'"):
        check_options({"dtyp": None})
    for owned in ("model", "example_inputs", "optimizer"):
        with pytest.raises(TypeError, match=f"'{owned}' is taken from the trainer"):
            check_options({owned: None})
