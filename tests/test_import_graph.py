"""The package's modules import each other without circles (every import, also those inside
functions and under TYPE_CHECKING): data types both sides need live in a module both import."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rewriter"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rewriter"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            found |= subs
            if len(subs) < len(node.names):  # names from the module itself
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found & set(known)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_in_the_package():
    known = _modules()
    graph = {m: _imports(p, known) - {m} for m, p in known.items()}
    assert "rewriter.pipeline" in graph and "rewriter.profile.advisor" in graph  # the walk saw the package
    assert _cycles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Modules allowed past the limit, each with the reason its one idea needs the room.
LONG_MODULES: dict[str, str] = {}
MAX_LINES = 600


def test_no_module_is_over_the_line_limit_without_a_stated_reason():
    long = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = {name: n for name, n in long.items() if n > MAX_LINES and name not in LONG_MODULES}
    assert over == {}


def test_the_stages_are_folders_that_say_what_they_take_and_give():
    import importlib

    for stage in ("capture", "decide", "profile", "devices"):
        module = importlib.import_module(f"rewriter.{stage}")
        doc = module.__doc__ or ""
        assert "takes" in doc.lower() or "take" in doc.lower(), stage
        assert "gives" in doc.lower(), stage
        assert len(list((ROOT / stage).glob("*.py"))) > 3, stage


def test_public_imports_keep_working():
    import rewriter
    import rewriter.integrations
    import rewriter.profiling as profiling

    assert callable(rewriter.optimize) and callable(rewriter.restore)
    assert isinstance(rewriter.Pass, type)
    assert callable(rewriter.amp.register_half_function)
    from rewriter.capture import graph_export
    assert rewriter.load_exported is graph_export.load_exported  # what written graphs tell users to import
    for name in profiling.__all__:
        assert hasattr(profiling, name), name
    assert callable(profiling.profile_model) and callable(profiling.compare)
