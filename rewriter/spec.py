"""SPEC loading for the offline script: ``package.module:factory`` or ``path/to/file.py:factory``.

The factory is called with no arguments and returns the model, or a ``(model, example_inputs)``
pair where ``example_inputs`` is a tuple of positional args or a dict of keyword args::

    factory = load_object("models/gpt.py:build")          # imports that one file, calls nothing
    model, example_inputs = build_model("models/gpt.py:build")

Only what the SPEC names runs: the file or module is imported (its top-level code runs, as any
import does), under a module name that is not ``"__main__"`` so an ``if __name__ == "__main__":``
block stays off; then the one factory is called. Nothing is unpickled: a factory builds its
model in Python, and a plan is JSON.

Model-only factories take inputs from ``--input`` specs (:func:`make_inputs`), e.g. ``2x128``
(float32 ``randn``) or ``input_ids=2x128:int64`` (integers below the model's
``config.vocab_size``).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn


def parse_spec(spec: str) -> tuple[str, str, bool]:
    """Split ``spec`` into ``(target, attribute, is_file)``; ValueError names what is wrong.

    The split is at the last ``:`` so a Windows drive letter (``C:\\m.py:build``) survives.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"SPEC {spec!r} has no ':'; write package.module:factory or "
                         "path/to/file.py:factory")
    target, _, attr = spec.rpartition(":")
    if not target:
        raise ValueError(f"SPEC {spec!r} names no module or file before ':'")
    if not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"SPEC {spec!r}: {attr!r} after ':' is not a Python name of a factory")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if not is_file and not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(f"SPEC {spec!r}: {target!r} is neither a path ending in .py nor a "
                         "dotted module name")
    return target, attr, is_file


def load_object(spec: str) -> Any:
    """Import the module or file ``spec`` names and return its attribute (a factory, a loss)."""
    target, attr, is_file = parse_spec(spec)
    module = _import_file(spec, target) if is_file else _import_module(spec, target)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = ".".join([target] + attr.split(".")[:i]) if i else target
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ValueError(f"SPEC {spec!r}: {where} has no attribute {part!r} "
                             f"(callables it defines: {', '.join(public[:12]) or 'none'})")
        obj = getattr(obj, part)
    return obj


def load_callable(spec: str, what: str = "factory") -> Callable[..., Any]:
    obj = load_object(spec)
    if not callable(obj):
        raise ValueError(f"SPEC {spec!r} names a {type(obj).__name__}, not a callable {what}")
    return obj


def build_model(spec: str) -> tuple[nn.Module, tuple | dict | None]:
    """Call the factory ``spec`` names: ``(model, example_inputs)``, inputs None when it gave none."""
    factory = load_callable(spec)
    with _on_path(_search_dir(spec)):  # a lazy ``import helpers`` inside the factory works too
        result = factory()
    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module):
        model, inputs = result
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, list):
            inputs = tuple(inputs)
        if not isinstance(inputs, (tuple, dict)):
            raise ValueError(f"factory {spec!r} returned example inputs of type "
                             f"{type(inputs).__name__}; return a tuple of positional args or a "
                             "dict of keyword args")
        if isinstance(inputs, dict) and not all(isinstance(k, str) for k in inputs):
            raise ValueError(f"factory {spec!r} returned a dict of example inputs whose keys are "
                             "not all argument names (str)")
        return model, inputs
    raise ValueError(f"factory {spec!r} returned {type(result).__name__}; expected an nn.Module "
                     "or a (model, example_inputs) pair")


# --- importing -----------------------------------------------------------------------------

def _search_dir(spec: str) -> str:
    """Where the SPEC's own imports look after installed packages: the file's directory, or
    the working directory for a module."""
    target, _, is_file = parse_spec(spec)
    return os.path.dirname(os.path.abspath(target)) if is_file else os.getcwd()


def _import_module(spec: str, name: str) -> Any:
    # The console script's sys.path[0] is its bin directory, not the working directory; the
    # working directory goes *last*, so a local file never shadows an installed package.
    with _on_path(_search_dir(spec)):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Only a missing SPEC module is a bad SPEC; a missing import inside it is the
            # user's code failing, and its traceback says more than we could.
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                raise ValueError(f"SPEC {spec!r}: no module named {e.name!r} (from the working "
                                 f"directory {os.getcwd()} or the installed packages)") from e
            raise


def _import_file(spec: str, path: str) -> Any:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ValueError(f"SPEC {spec!r}: file {path} does not exist")
    if not full.endswith(".py"):
        raise ValueError(f"SPEC {spec!r}: {path} is not a .py file")
    # One module per file, named after its path: loading the same file twice (the factory and
    # --loss) runs it once, and "__main__" guards stay off.
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    name = f"_rewriter_spec_{stem}_{hashlib.sha256(full.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"SPEC {spec!r}: cannot load {path} as Python source")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and typing look the module up while it executes
    try:
        # Its own directory, appended: ``import helpers`` beside the file works as it does
        # for ``python file.py``, without shadowing installed packages.
        with _on_path(_search_dir(spec)):
            module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@contextlib.contextmanager
def _on_path(directory: str) -> Iterator[None]:
    if directory in sys.path:
        yield
        return
    sys.path.append(directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)


# --- --input specs -------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "int64": torch.int64, "long": torch.int64,
           "int32": torch.int32, "bool": torch.bool}
_INPUT_RE = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<dims>\d+(?:x\d+)*)(?::(?P<dtype>\w+))?$")


def parse_input_spec(text: str) -> tuple[str | None, tuple[int, ...], torch.dtype]:
    """``[NAME=]D1xD2x...[:DTYPE]`` -> (name or None, shape, dtype); ValueError names the problem."""
    m = _INPUT_RE.match(text.strip())
    if m is None:
        raise ValueError(f"--input {text!r}: expected [NAME=]D1xD2...[:DTYPE], e.g. 4x256 or "
                         "input_ids=2x128:int64")
    dtype_name = m.group("dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ValueError(f"--input {text!r}: unknown dtype {dtype_name!r}; one of {sorted(_DTYPES)}")
    return m.group("name"), tuple(int(d) for d in m.group("dims").split("x")), _DTYPES[dtype_name]


def make_inputs(specs: list[str], model: nn.Module, seed: int = 0) -> tuple | dict:
    """Random example inputs from ``--input`` specs: all positional (in order) or all named.

    Floating inputs are ``randn``; integer inputs are token ids below ``model.config.vocab_size``
    (the only integer range we can know without being told).
    """
    if not specs:
        raise ValueError("the factory returned only a model; return (model, example_inputs) from "
                         "it, or describe the inputs with --input (e.g. --input 4x256)")
    gen = torch.Generator().manual_seed(seed)
    positional: list[torch.Tensor] = []
    named: dict[str, torch.Tensor] = {}
    for text in specs:
        name, shape, dtype = parse_input_spec(text)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        elif dtype == torch.bool:
            t = torch.ones(shape, dtype=torch.bool)
        else:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None)
            if not isinstance(vocab, int):
                raise ValueError(f"--input {text!r}: integer inputs need a value range, and "
                                 f"{type(model).__name__} has no config.vocab_size; return "
                                 "example inputs from the factory instead")
            t = torch.randint(0, vocab, shape, generator=gen, dtype=dtype)
        if name is None:
            positional.append(t)
        else:
            named[name] = t
    if positional and named:  # optimize() takes a tuple of args or a dict of kwargs
        raise ValueError("--input: give all inputs positionally or all by name, not both")
    return named if named else tuple(positional)
