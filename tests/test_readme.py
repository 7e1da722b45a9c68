"""The README's promises point at tests: every test it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
    }


def test_every_test_the_readme_names_exists() -> None:
    text = (ROOT / "README.md").read_text()
    refs = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text)
    assert len(refs) >= 7, "the complaints table should point at its tests"
    for path, name in refs:
        file = ROOT / path
        assert file.is_file(), f"README names {path}, which does not exist"
        if name:
            assert name in _test_names(file), f"README names {path}::{name}, which does not exist"
