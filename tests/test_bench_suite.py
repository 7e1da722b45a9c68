"""The benchmark suite measures the library as users get it, and says what it holds.

No file under ``benchmarks/`` patches asynccache: a figure measured with a private method
replaced, or a replaced behaviour brought back, is not a figure of the library. What a
benchmark varies goes through a public knob (a ``Settings`` field or a keyword). The
check reads the files' syntax trees (nothing is run):

* an assignment to an attribute of a name imported from asynccache (a module, a class or
  a function of it: ``dlmod.fetch_range = ...``, ``Pool.take = ...``), public or private;
* an assignment to a private attribute (``_x``) of an object made from such a name
  (``ds = StreamingDataset(...); ds._x = ...``), or of a parameter annotated with one;
* ``setattr`` / ``object.__setattr__`` on either, unless the attribute is a public one of
  an object (a property a user sets too).

The peers' objects in ``compare.py`` are not asynccache's and are not checked.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _root(node: ast.AST) -> str | None:
    """The name an expression starts from: ``a`` of ``a.b[0].c(d).e``."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Await):
            node = node.value
        else:
            return None


def _ours(tree: ast.AST) -> set[str]:
    """Names bound to asynccache by an import anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "asynccache" or a.name.startswith("asynccache."):
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if module == "asynccache" or module.startswith("asynccache."):
                out.update(a.asname or a.name for a in node.names)
    return out


def _targets(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            yield from _targets(elt)
    else:
        yield node


def _pairs(target: ast.AST, value: ast.AST) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(target, value) of an assignment, tuples unpacked element by element."""
    if (
        isinstance(target, ast.Tuple | ast.List)
        and isinstance(value, ast.Tuple | ast.List)
        and len(target.elts) == len(value.elts)
    ):
        for t, v in zip(target.elts, value.elts, strict=True):
            yield from _pairs(t, v)
    else:
        for t in _targets(target):
            yield t, value


def _made(tree: ast.AST, ours: set[str]) -> set[str]:
    """Variables holding objects made from asynccache names (flow-insensitive: a name
    bound to one anywhere counts everywhere in the file)."""
    made: set[str] = set()
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            bound: list[ast.AST] = []
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound = [
                    t
                    for target in targets
                    for t, v in _pairs(target, node.value)
                    if _root(v) in ours | made
                ]
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                if _root(node.context_expr) in ours | made:
                    bound = list(_targets(node.optional_vars))
            elif isinstance(node, ast.arg) and node.annotation is not None:
                names = {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)}
                bound = [ast.Name(node.arg)] if names & ours else []
            for t in bound:
                if isinstance(t, ast.Name) and t.id not in made and t.id not in ours:
                    made.add(t.id)
                    changed = True
    return made


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def patches(source: str, filename: str = "<bench>") -> list[str]:
    """Where ``source`` patches asynccache, one line each (empty: nowhere)."""
    tree = ast.parse(source, filename)
    ours = _ours(tree)
    made = _made(tree, ours)
    found: list[str] = []

    def check(obj: ast.AST, attr: str | None, line: int) -> None:
        root = _root(obj)
        what = f"{ast.unparse(obj)}.{attr if attr is not None else '<dynamic>'}"
        if root in ours:
            found.append(f"{filename}:{line}: assigns {what} of asynccache")
        elif root in made and (attr is None or _private(attr)):
            found.append(f"{filename}:{line}: assigns {what} of an asynccache object")

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            if isinstance(t, ast.Attribute):
                check(t.value, t.attr, t.lineno)
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            f = node.func
            is_setattr = isinstance(f, ast.Name) and f.id in ("setattr", "delattr")
            is_object_setattr = (
                isinstance(f, ast.Attribute)
                and f.attr in ("__setattr__", "__delattr__")
                and isinstance(f.value, ast.Name)
                and f.value.id == "object"
            )
            if is_setattr or is_object_setattr:
                name = node.args[1]
                attr = name.value if isinstance(name, ast.Constant) else None
                check(node.args[0], attr if isinstance(attr, str) else None, node.lineno)
    return found


def _bench_files() -> list[Path]:
    return sorted(BENCH.rglob("*.py"))


def test_no_benchmark_patches_asynccache() -> None:
    files = _bench_files()
    assert len(files) > 10  # the suite is there: the check reads something
    found = [p for f in files for p in patches(f.read_text(), str(f.relative_to(BENCH)))]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "import asynccache.download.downloader as dl\ndl.fetch_range = lambda: 0",
        "import asynccache.torch.batches as b\nb.Pool.take = lambda self, n: 0",
        "from asynccache.cache.layout import TempFile\nTempFile.publish = print",
        "from asynccache import StreamingDataset\nStreamingDataset._batch = None",
        "import asynccache\nasynccache.read.source.HINT_PAST = 3",
        "from asynccache.format import Index\nidx = Index(())\nobject.__setattr__(idx, '_cols', 1)",
        "from asynccache import StreamingDataset\nds = StreamingDataset('x')\nds._plan = None",
        "from asynccache import StreamingDataset as S\nds, n = S('x'), 1\nds._plan, n = None, 2",
        "from asynccache import Settings\ndef f(s: Settings):\n    s._x = 1",
        "import asynccache.download.downloader as dl\nsetattr(dl.Downloader, '_pump', None)",
        "from asynccache.testing import ObjectStore\nwith ObjectStore() as st:\n    st._proc = None",
        "from asynccache import CacheDataLoader\nd = CacheDataLoader(1).x\nsetattr(d, name, 1)",
    ],
)
def test_the_check_sees_a_patch(source: str) -> None:
    assert len(patches(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "class Mine:\n    def __init__(self):\n        self._x = 1",
        "from asynccache import StreamingDataset\nds = StreamingDataset('x')\nds.batch_size = 64",
        "import litdata.streaming.downloader as d\nd._client = None",
        "from asynccache import Settings\nsettings = Settings()\nx = settings._replace",
        "import os\nos.environ['ASYNCCACHE_PROGRESS'] = '0'",
        "from asynccache.cache import stamp\nimport os\nos.setxattr('p', stamp.ATTR, b'')",
    ],
)
def test_the_check_passes_what_is_no_patch(source: str) -> None:
    assert patches(source) == []


def test_the_suite_and_its_readme_agree() -> None:
    """Every named benchmark ``make bench`` runs exists; the README describes every named
    benchmark and every probe, and gives no command of a script that is gone."""
    sys.path.insert(0, str(BENCH))
    try:
        import run_all
    finally:
        sys.path.remove(str(BENCH))
    readme = (BENCH / "README.md").read_text()
    named = {script for _, script, _ in run_all.BENCHMARKS}
    for script in named:
        assert (BENCH / script).is_file(), script
        assert f"`{script}`" in readme, script
    for probe in (BENCH / "probes").glob("*.py"):
        assert f"`probes/{probe.name}`" in readme, probe.name
    commands = re.findall(r"benchmarks/([\w/]+\.py)", readme)
    assert commands
    for name in commands:
        assert (BENCH / name).is_file(), name
