"""SPEC loading: which code runs, what comes back, and errors that name the problem."""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from rewriter import spec

FACTORIES = "tests/factories/tiny_models.py"


@pytest.mark.parametrize("text, expected", [
    ("pkg.mod:build", ("pkg.mod", "build", False)),
    ("models/gpt.py:build", ("models/gpt.py", "build", True)),
    ("gpt.py:Builders.small", ("gpt.py", "Builders.small", True)),
    (r"C:\models\gpt.py:build", (r"C:\models\gpt.py", "build", True)),  # split at the last ':'
])
def test_parse_spec(text, expected):
    assert spec.parse_spec(text) == expected


@pytest.mark.parametrize("text, message", [
    ("models/gpt.py", "has no ':'"),
    (":build", "no module or file"),
    ("models/gpt.py:", "not a Python name"),
    ("pkg.mod:2fast", "not a Python name"),
    ("my-pkg.mod:build", "neither a path ending in .py nor a dotted module name"),
])
def test_bad_spec_is_a_value_error_naming_it(text, message):
    with pytest.raises(ValueError, match=message) as e:
        spec.parse_spec(text)
    assert repr(text) in str(e.value) or text.rpartition(":")[0] in str(e.value)


def test_file_and_module_specs_build_the_same_model():
    by_path, inputs = spec.build_model(f"{FACTORIES}:attention_block")
    by_module, _ = spec.build_model("tests.factories.tiny_models:attention_block")
    assert type(by_path).__name__ == type(by_module).__name__ == "AttentionBlock"
    assert isinstance(inputs, tuple) and inputs[0].shape == (2, 16, 32)
    for a, b in zip(by_path.state_dict().values(), by_module.state_dict().values()):
        assert torch.equal(a, b)  # both factories seed the same way


def test_missing_factory_names_the_spec_and_the_attribute():
    with pytest.raises(ValueError) as e:
        spec.load_object(f"{FACTORIES}:no_such_factory")
    text = str(e.value)
    assert FACTORIES in text and "no_such_factory" in text and "attention_block" in text


def test_missing_file_and_missing_module_are_named():
    with pytest.raises(ValueError, match="nowhere/model.py does not exist"):
        spec.load_object("nowhere/model.py:build")
    with pytest.raises(ValueError, match="no module named 'no_such_package_xyz'"):
        spec.load_object("no_such_package_xyz.models:build")


def test_a_missing_import_inside_the_users_module_is_their_error(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        spec.load_object(f"{tmp_path}/broken.py:build")


def test_not_callable_and_bad_returns_are_value_errors():
    with pytest.raises(ValueError, match="names a int, not a callable factory"):
        spec.load_callable(f"{FACTORIES}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="not_a_model.*returned int"):
        spec.build_model(f"{FACTORIES}:not_a_model")


def test_only_the_named_factory_runs(tmp_path):
    """Importing runs the file's top level once; its __main__ block and other functions do not
    run; a sibling module imports as it would under ``python file.py``."""
    log = tmp_path / "ran.txt"
    (tmp_path / "helpers_for_spec_test.py").write_text("WIDTH = 8\n")
    (tmp_path / "lazy_helpers_for_spec_test.py").write_text("OUT = 2\n")
    (tmp_path / "user_model.py").write_text(textwrap.dedent(f"""
        import torch
        from helpers_for_spec_test import WIDTH

        def _log(what):
            with open({str(log)!r}, "a") as f:
                f.write(what + "\\n")

        _log("top level")

        def build():
            _log("build")
            import lazy_helpers_for_spec_test  # imported when called, beside the file too
            return torch.nn.Linear(WIDTH, lazy_helpers_for_spec_test.OUT), (torch.randn(1, WIDTH),)

        def other():
            _log("other")

        if __name__ == "__main__":
            _log("main")
    """))
    path_before = list(sys.path)
    model, inputs = spec.build_model(f"{tmp_path}/user_model.py:build")
    spec.load_object(f"{tmp_path}/user_model.py:other")  # loaded again, not run again
    assert log.read_text().split() == ["top", "level", "build"]
    assert isinstance(model, nn.Linear) and model.out_features == 2 and inputs[0].shape == (1, 8)
    assert sys.path == path_before  # the file's directory was on the path only while needed


def test_inputs_are_normalised():
    class Tiny(nn.Module):
        def forward(self, x):
            return x

    def returns(value):
        mod = type(sys)("spec_test_returns")
        mod.factory = lambda: value
        sys.modules["spec_test_returns"] = mod
        try:
            return spec.build_model("spec_test_returns:factory")
        finally:
            del sys.modules["spec_test_returns"]

    x = torch.ones(2)
    assert returns(Tiny())[1] is None
    assert returns((Tiny(), x))[1][0] is x                 # one tensor -> (tensor,)
    assert returns([Tiny(), [x]])[1] == (x,)               # lists -> tuples
    assert returns((Tiny(), {"x": x}))[1] == {"x": x}
    with pytest.raises(ValueError, match="example inputs of type int"):
        returns((Tiny(), 3))
    with pytest.raises(ValueError, match="keys are not all argument names"):
        returns((Tiny(), {1: x}))


@pytest.mark.parametrize("text, expected", [
    ("4x256", (None, (4, 256), torch.float32)),
    ("input_ids=2x128:int64", ("input_ids", (2, 128), torch.int64)),
    ("x=3:bf16", ("x", (3,), torch.bfloat16)),
])
def test_parse_input_spec(text, expected):
    assert spec.parse_input_spec(text) == expected


@pytest.mark.parametrize("text, message", [
    ("4 by 256", "expected \\[NAME=\\]D1xD2"),
    ("4x256:complex7", "unknown dtype 'complex7'"),
])
def test_bad_input_spec_names_it(text, message):
    with pytest.raises(ValueError, match=message):
        spec.parse_input_spec(text)


def test_make_inputs():
    plain = nn.Linear(4, 4)
    (x,) = spec.make_inputs(["3x4"], plain)
    assert x.shape == (3, 4) and x.dtype == torch.float32
    vocab_model = nn.Embedding(50, 4)
    vocab_model.config = type("Config", (), {"vocab_size": 50})()
    ids = spec.make_inputs(["input_ids=2x7:int64"], vocab_model)["input_ids"]
    assert ids.shape == (2, 7) and int(ids.min()) >= 0 and int(ids.max()) < 50
    with pytest.raises(ValueError, match="no config.vocab_size"):
        spec.make_inputs(["2x7:int64"], plain)
    with pytest.raises(ValueError, match="not both"):
        spec.make_inputs(["3x4", "y=3x4"], plain)
    with pytest.raises(ValueError, match="--input"):
        spec.make_inputs([], plain)
