"""docs/architecture.md states which layer may import which: every import of the package
(module level or inside a function) must follow it, and torch is imported only where the
page says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "asynccache"
EVERYTHING_BELOW = re.compile(r"everything in layers 0-(\d+)")
TORCH_ALLOWED = ("asynccache/torch/", "asynccache/testing/resume.py")
# Decoding a torch leaf makes a tensor: the format imports torch there, lazily (optional).
TORCH_LAZY_ALLOWED = ("asynccache/format/items.py",)


def _layers() -> tuple[dict[str, int], dict[str, set[str]]]:
    """From the page's table: each unit's layer, and what it may import."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    layer_of: dict[str, int] = {}
    rules: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        for unit in re.findall(r"`(\w+)`", cells[1]):
            layer_of[unit] = int(cells[0])
            rules[unit] = cells[2]
    allowed: dict[str, set[str]] = {}
    for unit, rule in rules.items():
        if rule == "everything":
            allowed[unit] = set(layer_of)
        elif m := EVERYTHING_BELOW.fullmatch(rule):
            allowed[unit] = {u for u, n in layer_of.items() if n <= int(m.group(1))}
        else:
            allowed[unit] = set(re.findall(r"`(\w+)`", rule))
    return layer_of, allowed


def _unit(module: str) -> str:
    parts = module.split(".")
    return "asynccache" if len(parts) == 1 else parts[1]


def _modules() -> list[tuple[Path, str, bool]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out.append((path, ".".join(parts), is_pkg))
    return out


def _imports(path: Path, module: str, is_pkg: bool) -> list[tuple[int, str]]:
    """Every asynccache module ``path`` imports (resolved), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                targets = [node.module or ""]
            found += [(node.lineno, t) for t in targets if t.startswith("asynccache")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("asynccache")]
    return found


def test_the_page_names_every_unit_of_the_package() -> None:
    layer_of, _ = _layers()
    units = {_unit(m) for _, m, _ in _modules()}
    assert units <= set(layer_of), f"not on docs/architecture.md: {units - set(layer_of)}"


def test_every_import_follows_the_layers() -> None:
    _, allowed = _layers()
    wrong = []
    for path, module, is_pkg in _modules():
        me = _unit(module)
        for line, target in _imports(path, module, is_pkg):
            other = _unit(target)
            if other != me and other not in allowed[me]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {target}")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def test_torch_is_imported_only_where_the_page_says() -> None:
    wrong = []
    for path, _, _ in _modules():
        rel = str(path.relative_to(ROOT))
        if rel.startswith(TORCH_ALLOWED):
            continue
        tree = ast.parse(path.read_text())
        nodes = tree.body if rel in TORCH_LAZY_ALLOWED else list(ast.walk(tree))
        for node in nodes:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            wrong += [f"{rel}:{node.lineno}" for n in names if n.split(".")[0] == "torch"]
    assert not wrong, f"torch imported outside the torch layer: {wrong}"


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    """The checker itself: an import up the layers is reported."""
    _, allowed = _layers()
    bad = tmp_path / "bad.py"
    bad.write_text("from ..torch import streaming\n")
    found = _imports(bad, "asynccache.format.bad", False)
    assert found == [(1, "asynccache.torch")]
    assert "torch" not in allowed["format"]
