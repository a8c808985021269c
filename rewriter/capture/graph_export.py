"""Write the rewritten graphs as Python source, for reading and (fx captures) for reuse.

A whole-model fx capture becomes a loadable module: a class whose ``forward`` is the rewritten
graph, running on the ORIGINAL model's parameters and buffers (shared, never copied or
pickled), so a checkpoint loads into the original model as usual::

    paths = write_graph_code(fast, "out/graphs")       # fast: what rewriter.optimize returned
    mod = load_exported("out/graphs/optimized_model.py")
    rewritten = mod.load(model)                           # model: the original, with its weights
    y = rewritten(x)

Dynamo captures hand over one graph per captured region (graph breaks run as Python between
them), so each graph's code is written for reading: ``graph_0.py``, ``graph_1.py``, ...

Tensor constants the tracer baked into a graph (a mask computed from a buffer, say) are not the
original's tensors; small ones are written as literals, larger ones as raw bytes beside the
module (``<module>_constants/<name>.bin``, read back with ``torch.frombuffer``; no pickle).
"""
from __future__ import annotations

import builtins
import importlib.util
import os
import re
import shutil
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.fx import GraphModule

LITERAL_MAX_ELEMENTS = 16  # a few values read well inline; larger constants go to a file
MODULE_FILE = "optimized_model.py"
CONSTANTS_DIR = "optimized_model_constants"


class ExportError(Exception):
    """The graph cannot be written as a loadable module (its code is still written)."""


@dataclass
class ExportResult:
    """What was written: file paths, and whether ``MODULE_FILE`` is loadable."""

    paths: list[str] = field(default_factory=list)
    loadable: str | None = None  # path of the loadable module, when one was written
    note: str = ""  # why there is none, or what was written instead


def write_graph_code(fast: nn.Module, directory: str | os.PathLike) -> ExportResult:
    """Write each graph ``fast`` (an OptimizedModel) runs; a loadable module for fx captures."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    _remove_earlier_export(directory)
    outcome = fast.__dict__.get("_outcome")
    capture = getattr(outcome, "capture", None)
    result = ExportResult()
    if capture is None:
        result.note = "nothing captured: no graph code to write"
        return result
    original = fast.original
    kept = [] if outcome.use_original else [p.name for p in outcome.kept]
    training = bool(getattr(capture, "training", original.training))
    # When the whole-model check rejected the rewrites, the slots still hold them: the graphs
    # as captured are what describes the model that runs.
    graphs = [(s.name, s.kept_run if kept else s.original) for s in capture.slots]
    if capture.front_end == "fx":
        gm = graphs[0][1]
        path = os.path.join(directory, MODULE_FILE)
        try:
            source, constants = module_source(gm, original, kept, training)
        except ExportError as e:
            result.note = f"not loadable ({e}); graph code written for reading"
            result.paths.append(_write(os.path.join(directory, "graph_0.py"),
                                       _reading_source(gm, "graph_0 (fx, whole model)", kept)))
            return result
        result.paths += _write_constants(directory, constants)
        result.paths.append(_write(path, source))
        result.loadable = path
        result.note = "loadable module (runs on the original model's parameters)"
        if not kept:
            result.note += "; nothing was kept, so it is the graph as traced"
        return result
    for i, (name, gm) in enumerate(graphs):
        title = f"{name} ({capture.front_end} graph {i + 1} of {len(graphs)})"
        result.paths.append(_write(os.path.join(directory, f"{name}.py"),
                                   _reading_source(gm, title, kept)))
    result.note = (f"{len(capture.slots)} {capture.front_end} graph(s), for reading: Dynamo runs "
                   "them between the model's Python, so they are not standalone modules")
    return result


def _remove_earlier_export(directory: str) -> None:
    """Files an earlier export wrote here, by our own names only: a graph_7.py left from
    another model must not pass for this one's."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if re.fullmatch(r"graph_\d+\.py", name) or name == MODULE_FILE:
            os.remove(path)
        elif name == CONSTANTS_DIR and os.path.isdir(path):
            shutil.rmtree(path)


def load_exported(path: str | os.PathLike) -> types.ModuleType:
    """Import a module written by :func:`write_graph_code` (it reads its constants beside it)."""
    path = os.path.abspath(os.fspath(path))
    name = f"_rewriter_export_{abs(hash(path)):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the loadable module -------------------------------------------------------------------

def module_source(gm: GraphModule, original: nn.Module, kept: list[str], training: bool
                  ) -> tuple[str, dict[str, torch.Tensor]]:
    """Source of a module running ``gm`` (traced in ``training`` mode) on ``original``'s
    tensors, and the constants it reads from files (by file name). Raises ExportError when
    something in the graph cannot be written as source."""
    name = type(original).__name__
    code = gm.graph.python_code(root_module="self")
    imports = _import_lines(code.globals)
    literals, files = _constants(gm, original)
    cls = f"Rewritten{name}" if name.isidentifier() else "RewrittenModel"
    mode = "train" if training else "eval"
    lines = [
        f'"""{name} with rewriter\'s kept rewrites ({", ".join(kept) or "none"}), as Python.',
        "",
        f"Written by `rewriter optimize` (torch {torch.__version__}) from a torch.fx capture in "
        f"{mode} mode.",
        "It holds no weights: it runs on the original model's parameters and buffers (shared, not",
        "copied), so load checkpoints into the original model as usual::",
        "",
        "    from rewriter import load_exported",
        f"    rewritten = load_exported(\"{MODULE_FILE}\").load(model)   # model: the original {name}",
        "    y = rewritten(*inputs)",
        "",
        f"The graph was traced in {mode} mode (dropout, BatchNorm behaviour baked in) and with the",
        "example inputs' shapes where the model read them as constants.",
        '"""',
        *sorted(imports),
        "import os as _os",
        "",
        "import torch as _torch",
        "",
        "_HERE = _os.path.dirname(_os.path.abspath(__file__))",
        "",
        "",
        "def _constant(file_name, dtype, shape):",
        '    """A tensor constant the tracer baked into the graph, stored as raw bytes (no pickle)."""',
        '    with open(_os.path.join(_HERE, file_name), "rb") as f:',
        "        data = bytearray(f.read())",
        "    return _torch.frombuffer(data, dtype=dtype).reshape(shape).clone()",
        "",
        "",
        f"class {cls}(_torch.nn.Module):",
        f'    """Runs the rewritten graph on an original {name}\'s parameters and buffers."""',
        "",
        "    def __init__(self, original):",
        "        super().__init__()",
        "        # Share the original's registries: the same tensor objects under the same names,",
        "        # so state_dict() keys and training updates are the original's.",
        '        self.__dict__["_parameters"] = original._parameters',
        '        self.__dict__["_buffers"] = original._buffers',
        '        self.__dict__["_modules"] = original._modules',
        '        self.__dict__["_non_persistent_buffers_set"] = original._non_persistent_buffers_set',
        f"        self.training = {training}",
        "        # Constants are plain attributes, not buffers: a buffer would be added to the",
        "        # original's shared registry. They go where the original's tensors are.",
        "        home = next(iter([*original.parameters(), *original.buffers()]), _torch.empty(0)).device",
    ]
    for attr, value in sorted(literals.items()):
        lines.append(f'        self.__dict__[{attr!r}] = {value}.to(home)')
    for attr, (file_name, t) in sorted(files.items()):
        lines.append(f'        self.__dict__[{attr!r}] = _constant({file_name!r}, {_dtype_src(t.dtype)}, '
                     f'{list(t.shape)}).to(home)')
    lines += [
        "",
        "    def _apply(self, fn, recurse=True):",
        "        # .to()/.cuda()/.half() move the shared tensors; the constants move along.",
        "        super()._apply(fn, recurse)",
        f"        for attr in {sorted(set(literals) | set(files))!r}:",
        "            self.__dict__[attr] = fn(self.__dict__[attr])",
        "        return self",
        "",
        _indent(code.src.strip("\n"), 4),
        "",
        "",
        f"def load(original) -> {cls}:",
        f'    """The rewritten {name}, running on ``original``\'s parameters and buffers."""',
        f"    return {cls}(original)",
        "",
    ]
    return "\n".join(lines), {f: t for f, t in files.values()}


def _import_lines(globals_: dict[str, Any]) -> list[str]:
    """One import (or assignment) per global the generated code names."""
    lines = []
    for name, obj in globals_.items():
        if name == "torch" or obj is torch:
            lines.append("import torch")
        elif isinstance(obj, types.ModuleType):
            lines.append(f"import {obj.__name__} as {name}")
        elif isinstance(obj, str):  # a type annotation fx keeps as a string ("torch.Tensor")
            lines.append(f"{name} = {obj!r}")
        elif obj is type(None):
            lines.append(f"{name} = type(None)")
        elif isinstance(obj, float):  # inf, nan
            lines.append(f"from math import {name}" if name in ("inf", "nan") else f"{name} = {obj!r}")
        elif getattr(builtins, name, None) is obj:
            continue
        else:
            lines.append(_import_object(name, obj))
    return list(dict.fromkeys(lines))


def _import_object(name: str, obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not module or not qualname or "<" in qualname:
        raise ExportError(f"the graph calls {obj!r}, which has no importable name")
    # Only modules already imported are named: importing here could run arbitrary code.
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not obj:
        raise ExportError(f"the graph calls {obj!r}, which is not reachable as {module}.{qualname}")
    head, _, rest = qualname.partition(".")
    if not rest:
        return f"from {module} import {head} as {name}" if head != name else f"from {module} import {name}"
    return f"from {module} import {head} as _{name}_owner\n{name} = _{name}_owner.{rest}"


def _constants(gm: GraphModule, original: nn.Module
               ) -> tuple[dict[str, str], dict[str, tuple[str, torch.Tensor]]]:
    """Tensors the graph reads that are not the original's parameters, buffers or submodules.

    Registries, not attributes, decide: symbolic_trace stores the constants it bakes in
    (``_tensor_constant0``) as attributes of the traced model itself, which a freshly built
    model does not have.
    """
    owned = ({n for n, _ in original.named_parameters(remove_duplicate=False)}
             | {n for n, _ in original.named_buffers(remove_duplicate=False)}
             | {n for n, _ in original.named_modules(remove_duplicate=False)})
    literals: dict[str, str] = {}
    files: dict[str, tuple[str, torch.Tensor]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target not in owned:
            raise ExportError(f"the graph calls submodule {node.target}, which the original has not")
        if node.op != "get_attr" or node.target in owned:
            continue
        value = _get_path(gm, node.target)
        if "." in node.target or not node.target.isidentifier():
            raise ExportError(f"the graph reads {node.target}, which is not on the original model")
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"the graph reads {node.target}, a {type(value).__name__}")
        t = value.detach().cpu()
        if t.numel() <= LITERAL_MAX_ELEMENTS:
            literals[node.target] = (f"_torch.tensor({t.tolist()!r}, dtype={_dtype_src(t.dtype)})"
                                     f".reshape({list(t.shape)})")
        else:
            files[node.target] = (f"{CONSTANTS_DIR}/{node.target}.bin",
                                  t.contiguous())
    return literals, files


def _write_constants(directory: str, constants: dict[str, torch.Tensor]) -> list[str]:
    paths = []
    for file_name, t in constants.items():
        path = os.path.join(directory, file_name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Raw bytes in the tensor's own dtype: frombuffer reads them back exactly.
        with open(path, "wb") as f:
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        paths.append(path)
    return paths


def _dtype_src(dtype: torch.dtype) -> str:
    return "_torch." + str(dtype).removeprefix("torch.")


def _get_path(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# --- code for reading ----------------------------------------------------------------------

def _reading_source(gm: GraphModule, title: str, kept: list[str]) -> str:
    code = gm.graph.python_code(root_module="self")
    try:
        imports = sorted(_import_lines(code.globals))
    except ExportError as e:
        imports = [f"# (imports omitted: {e})"]
    header = [f'"""{title}: the graph as it runs after rewriter\'s kept rewrites '
              f'({", ".join(kept) or "none"}).', "",
              "Written for reading by `rewriter optimize`; it is not a standalone module.", '"""']
    return "\n".join(header + imports + ["", "", code.src.strip("\n"), ""])


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "\n".join(pad + line if line.strip() else line for line in text.splitlines())


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path
