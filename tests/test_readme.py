"""The README and docs/ stay a manual: what they name exists, and run histories live apart.

* Every test the README's promises table names exists.
* Every ``ASYNCCACHE_*`` setting ``Settings`` knows has a row in the README's configuration
  table, and every row names a setting that exists.
* README.md and docs/*.md hold no commit ids, clock times or dates: dated measurements,
  with the commit and the hour they were taken at, belong in docs/performance.md alone.
* Every link from README.md or docs/*.md to a file of the repository, and to a heading of
  a Markdown page, leads somewhere.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from asynccache.config import PREFIX, Settings

ROOT = Path(__file__).resolve().parent.parent
# The one page allowed to carry dates, commit ids and clock times.
DATED = ROOT / "docs" / "performance.md"

# A date as a run history writes it: 2026-12-02.
_DATE = re.compile(r"(?<![\w-])(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?![\w-])")
# A clock time: 15:06, 9:50, 23:41:07 (not a ratio such as 1:1, nor a link's 20:4).
_CLOCK = re.compile(r"(?<![\w:.])(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?![\w:])")
# A commit id: a word of 7-12 hex digits (or a full 40) holding both digits and letters,
# not glued to a colon, a slash or a dot (checksums such as xxh3_64:9a1f0c3e5b7d2468,
# paths and version strings are not commits).
_COMMIT = re.compile(
    r"(?<![\w:/.#-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])(?:[0-9a-f]{40}|[0-9a-f]{7,12})(?![\w/.-])"
)
_CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without code: blocks and spans may hold an API's version string or a link
    setting such as ``--link 20:4``, never a measurement's date."""
    return _CODE_SPAN.sub("``", _CODE_BLOCK.sub("", text))


def undated_findings(text: str) -> list[str]:
    """What in ``text`` reads as a commit id, a clock time or a date."""
    prose = _prose(text)
    return (
        [f"commit id {m.group()!r}" for m in _COMMIT.finditer(text)]
        + [f"clock time {m.group()!r}" for m in _CLOCK.finditer(prose)]
        + [f"date {m.group()!r}" for m in _DATE.finditer(prose)]
    )


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


def _configuration_rows() -> list[str]:
    """The variables named in the first column of the README's configuration table."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Configuration\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "the README has a '## Configuration' section"
    return re.findall(rf"^\| `({PREFIX}[A-Z_]+)`", section.group(1), re.M)


def test_the_configuration_table_names_every_setting() -> None:
    rows = _configuration_rows()
    known = [PREFIX + f.name.upper() for f in dataclasses.fields(Settings)]
    missing = [name for name in known if name not in rows]
    assert not missing, f"the README's configuration table lacks {missing}"
    unknown = [name for name in rows if name not in known]
    assert not unknown, f"the README's configuration table names unknown settings {unknown}"
    assert len(rows) == len(set(rows)), "a setting has two rows"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_history_outside_performance_md(page: Path) -> None:
    if page == DATED:
        pytest.skip("the dated record of measurements")
    found = undated_findings(page.read_text())
    assert not found, (
        f"{page.relative_to(ROOT)} holds {found[:8]}: dated figures and their commits "
        "belong in docs/performance.md"
    )


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("measured at 15:06 UTC", ["clock time '15:06'"]),
        (
            "(2026-12-02 09:50-09:54 UTC)",
            ["clock time '09:50'", "clock time '09:54'", "date '2026-12-02'"],
        ),
        ("since commit 632a4bb, a durable", ["commit id '632a4bb'"]),
        ("(acc8727, load 2)", ["commit id 'acc8727'"]),
        ("on 2026-12-02 the", ["date '2026-12-02'"]),
        ("0.94 / 0.83 of the bare loop, 1.5x its CPU, 16:9", []),
        ("`--link 20:4`, `x-ms-version 2021-12-02`", []),
        ('"checksum": "xxh3_64:9a1f0c3e5b7d2468", chunk-0-1.bin, v0.13.0', []),
        ("```\nfrom 12:00 to 12:05\n```\n", []),
        ("a 1,024-chunk index, deadbeef, 2 workers", []),
    ],
)
def test_the_patterns_tell_history_from_ordinary_text(text: str, found: list[str]) -> None:
    assert undated_findings(text) == found


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _CODE_BLOCK.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M)}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_pages_resolve(page: Path) -> None:
    text = _CODE_BLOCK.sub("", page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        missing = not file.exists()
        if missing or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to {broken}, which lead nowhere"
