"""The README's guarantees table names tests that exist (so the table cannot drift from them)."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _test_functions(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_test_the_guarantees_table_names_exists():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Guarantees and their tests", 1)[1].split("\n## ", 1)[0]
    named: list[tuple[str, str]] = []
    for row in table.splitlines():
        current = None
        for ref in re.findall(r"`([^`]*::test_\w+|tests/\w+\.py)`", row):
            if "::" in ref:
                path, name = ref.split("::")
                current = path if path else current
                named.append((current, name))
            else:
                current = ref
    assert len(named) >= 30
    for path, name in named:
        assert path is not None and (ROOT / path).exists(), f"{path} (for {name})"
        assert name in _test_functions(ROOT / path), f"{path}::{name} named in README does not exist"
