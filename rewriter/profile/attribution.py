"""Which line of the model an operator call came from, and for a backward operator, which
forward operation created it.

torch.profiler with ``with_stack=True`` records Python frames as events around the operators
(``model.py(5): forward``, ``<built-in method matmul ...>``, ``nn.Module: Block_0``); the line
of a frame event is where its function is *defined*, so the call inside it is found in the
function's source by the name of the C function it called (``matmul`` in
``torch.matmul(x, self.w1.t())``). An fx ``GraphModule``'s generated code carries its nodes'
``stack_trace`` as ``# File: model.py:6 in forward, code: ...`` comments, which are read instead.
Backward operators run inside ``autograd::engine::evaluate_function: MmBackward0`` events whose
``sequence_nr`` (with ``fwd_thread``) is that of the forward operator that recorded the graph
node (the profiler's ``Sequence number`` / ``Fwd thread id``)::

    from rewriter.profile.attribution import origin_from_frames, Origin

    origin_from_frames(["aten::matmul", "<built-in method matmul of type object at 0x1>",
                        "model.py(5): forward", "nn.Module: Block_0"])
    # Origin(function='Block.forward', file='model.py', line=6, code='y = torch.matmul(...)', ...)
"""
from __future__ import annotations

import ast
import functools
import linecache
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Sequence

__all__ = ["Origin", "origin_from_frames", "backward_origin", "is_python_frame", "user_frame"]

_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>\S+)$")
_BUILTIN = re.compile(r"^<built-in (?:method|function) (?P<name>\w+)")
_MODULE = re.compile(r"^nn\.Module: (?P<cls>\w+)$")  # class and instance: ``Conv1D_4``
# Frames that are not the user's model: torch itself, this project, the interpreter.
_LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}rewriter{os.sep}", f"{os.sep}torch_npu{os.sep}",
                  f"{os.sep}contextlib.py", f"{os.sep}functools.py", f"{os.sep}threading.py")
_LIBRARY_PREFIXES = ("torch/", "rewriter/", "torch_npu/", "<frozen ", "contextlib.py", "functools.py")
_FX_FILE = "<eval_with_key>"
_FX_COMMENT = re.compile(r"#\s*File: (?P<file>.+?):(?P<line>\d+) in (?P<func>\S+), code: (?P<code>.*)$")


@dataclass(frozen=True)
class Origin:
    """Where an operator call came from: the model's ``function`` (``Block.forward``), its
    ``file`` and ``line``, the line's ``code``, the ``module`` chain (``Block.Linear``, from
    module events) and, for a backward operator, ``backward`` True and ``grad_fn``
    (``MmBackward0``)."""

    function: str
    file: str
    line: int
    code: str = ""
    module: str = ""
    backward: bool = False
    grad_fn: str = ""

    @property
    def where(self) -> str:
        """``Block.forward model.py:6`` (the file's base name)."""
        return f"{self.function} {os.path.basename(self.file)}:{self.line}" if self.file else self.function

    @property
    def module_tail(self) -> str:
        """The innermost three modules of the chain: ``GPT2Block_1.GPT2Attention_1.Conv1D_4``."""
        return ".".join(self.module.split(".")[-3:]) if self.module else ""

    def describe(self) -> str:
        """```Block.forward` [Block_0] model.py:6 `torch.matmul(x, self.w1.t())` (backward: MmBackward0)``;
        the bracket holds the module chain (class_instance, as the profiler numbers them)."""
        text = f"`{self.function}`"
        if self.module:
            text += f" [{self.module_tail}]"
        if self.file:
            text += f" {os.path.basename(self.file)}:{self.line}"
        if self.code:
            text += f" `{self.code}`"
        if self.backward:
            text += f" (backward{': ' + self.grad_fn if self.grad_fn else ''})"
        return text

    def forward(self) -> "Origin":
        """The same line as a forward origin (what a backward operator is grouped under)."""
        return replace(self, backward=False, grad_fn="")

    def to_dict(self) -> dict:
        return asdict(self)


def is_python_frame(name: str) -> bool:
    """Whether a profiler event is a Python frame or module annotation of ``with_stack``,
    rather than an operator::

        is_python_frame("model.py(5): forward"), is_python_frame("aten::mm")  # True, False
    """
    return bool(_FRAME.match(name) or name.startswith(("<built-in ", "nn.Module: ", "nn.Optimizer: ")))


def _is_library(path: str) -> bool:
    return path.startswith(_LIBRARY_PREFIXES) or any(p in path for p in _LIBRARY_PARTS)


def user_frame(frames: Sequence[str]) -> tuple[int, re.Match] | None:
    """The innermost frame (index, match) that is the user's code, not torch's or ours."""
    for i, name in enumerate(frames):
        m = _FRAME.match(name)
        if m and not _is_library(m["file"]):
            return i, m
    return None


@functools.lru_cache(maxsize=256)
def _functions(path: str) -> tuple[tuple[int, int, str], ...]:
    """(def line, end line, qualified name) of every function in a source file."""
    source = "".join(linecache.getlines(path))
    if not source:
        return ()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((first, child.end_lineno or child.lineno, prefix + child.name))
                visit(child, prefix + child.name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(tree, "")
    return tuple(found)


def _enclosing(path: str, line: int) -> tuple[str, int] | None:
    """(qualified name, end line) of the innermost function defined at or around ``line``."""
    best = None
    for first, last, name in _functions(path):  # outer functions come before nested ones
        if first <= line <= last:
            best = (name, last, first == line)
    return (best[0], best[1]) if best else None


def _call_line(path: str, line: int, func: str, callee: str | None) -> tuple[str, int, str]:
    """(qualified function, line, code) of an operator's call. ``line`` is a frame's: the
    function's def line for the python tracer's frames (co_firstlineno), then the call is the
    first line of its body that calls ``callee``; a call-site line (NPU call stacks) is kept.
    The def line stands, without code, when the call is not found (a module called as
    ``self.proj(x)``: the module chain names it)."""
    found = _enclosing(path, line)
    qual, end = (found if found and found[0].rsplit(".", 1)[-1] == func else (func, line))
    lines = linecache.getlines(path)
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    if not text.startswith(("def ", "async def ", "@")):
        return qual, line, text
    patterns = []
    if callee:
        patterns.append(re.compile(r"(?<![\w])" + re.escape(callee) + r"\s*\("))
        if callee in _SPELLINGS:  # ``x += b`` calls no named function: its operator spelling
            patterns.append(re.compile(_SPELLINGS[callee]))
    for pattern in patterns:
        for n in range(line + 1, min(end, len(lines)) + 1):
            code = lines[n - 1].strip()
            if pattern.search(code) and not code.startswith("#"):
                return qual, n, code
    return qual, line, ""  # the function's def line: its code would only show the signature


# Python operators that dispatch to an aten operator without a named C call in the stack.
_SPELLINGS = {"add_": r"\+=", "sub_": r"-=", "mul_": r"\*=", "div_": r"/=", "matmul": r"[^@]@[^=@]",
              "mm": r"[^@]@[^=@]", "bmm": r"[^@]@[^=@]", "add": r"[\w)\]] *\+ *[\w(]",
              "mul": r"[\w)\]] *\* *[\w(]", "sub": r"[\w)\]] *- *[\w(]", "div": r"[\w)\]] */ *[\w(]"}


def _fx_origin(path: str, line: int) -> tuple[str, str, int, str] | None:
    """The ``# File: ... code: ...`` comment above a line of fx-generated code."""
    lines = linecache.getlines(path)
    for n in range(min(line, len(lines)), 0, -1):
        m = _FX_COMMENT.search(lines[n - 1])
        if m:
            return m["func"], m["file"], int(m["line"]), m["code"].strip()
    return None


def origin_from_frames(frames: Sequence[str], callee: str | None = None) -> Origin | None:
    """The origin of an operator from the names of the events around it, innermost first (the
    operator's parents in a torch profile: C calls, Python frames, ``nn.Module:`` events; or an
    NPU ``Call Stack``). ``callee`` names the function to look for when no C-call event says
    (``addmm`` for ``aten::addmm``).

    None when no frame is the user's code (a profile without ``with_stack``)."""
    found = user_frame(frames)
    # The optimizer's own code: its annotation (``Optimizer.step#AdamW.step``) names it, also
    # when user code lies further out (the training loop, or a console script's ``<module>``).
    step = next((k for k, f in enumerate(frames)
                 if f.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))), None)
    if step is not None and (found is None or step < found[0]):
        return Origin(frames[step], "", 0)
    if found is None:
        return None
    i, m = found
    path, def_line, func = m["file"], int(m["line"]), m["func"]  # linecache finds relative paths
    for name in reversed(frames[:i]):  # the C function the frame called, nearest the frame
        b = _BUILTIN.match(name)
        if b:
            callee = b["name"]
            break
    modules = [mm["cls"] for name in frames if (mm := _MODULE.match(name))]  # torch's modules too
    module = ".".join(reversed(modules))
    if path.startswith(_FX_FILE):
        # fx code: the generated line is found like any call, then its node's comment read
        _, line, _ = _call_line(path, def_line, func, callee)
        fx = _fx_origin(path, line)
        if fx is not None:
            fn, file, ln, code = fx
            return Origin(fn, file, ln, code, module)
    qual, line, code = _call_line(path, def_line, func, callee)
    return Origin(qual, path, line, code, module)


def backward_origin(forward: Origin | None, grad_fn: str) -> Origin | None:
    """A backward operator's origin: the forward origin that recorded ``grad_fn``."""
    if forward is None:
        return None
    return replace(forward, backward=True, grad_fn=grad_fn)
