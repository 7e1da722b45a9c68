"""The ``asynccache`` command, run for real against datasets on disk and in SeaweedFS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import asynccache
from asynccache.cache.indexfile import read_dir
from asynccache.cli import main
from asynccache.testing import ObjectStore

pytestmark = pytest.mark.timeout(120)

ITEMS = 10


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Ten items of three per chunk: four chunks and an ``index.json``."""
    root = tmp_path / "ds"
    cache = asynccache.Cache(root, chunk_size=3)
    for i in range(ITEMS):
        cache[i] = {"i": i}
    cache.done()
    return root


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCACHE_PROGRESS", "0")


def _options(objstore: ObjectStore) -> list[str]:
    out = []
    for key, value in objstore.storage_options.items():
        out += ["--storage-option", f"{key}={value}"]
    return out


def _chunks(root: Path) -> list[str]:
    return [c.filename for c in read_dir(str(root)).chunks]


def test_inspect_prints_the_index_summary(
    dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(dataset)]) == 0
    out = capsys.readouterr().out
    rows = {k.strip(): v.strip() for k, v in (line.split("  ", 1) for line in out.splitlines())}
    assert rows["items"] == "10"
    assert rows["chunks"] == "4"
    assert rows["format version"] == "2"
    assert rows["chunk items"] == "min 1, median 3, max 3"
    assert rows["chunk bytes"].startswith("min ")
    assert json.loads(rows["writer config"])["chunk_size"] == 3


def test_verify_ok(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(dataset)]) == 0
    out = capsys.readouterr().out
    assert "4 chunks checked: 4 ok, 0 bad; 10 of 10 items decoded" in out
    assert "BAD" not in out


def test_verify_names_a_corrupted_chunk(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = dataset / _chunks(dataset)[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["verify", str(dataset)]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1
    assert victim.name in bad[0] and "checksum" in bad[0]
    assert "3 ok, 1 bad" in out


def test_verify_reports_a_truncated_and_a_missing_chunk(
    dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = _chunks(dataset)
    (dataset / names[0]).write_bytes((dataset / names[0]).read_bytes()[:-5])
    (dataset / names[2]).unlink()
    assert main(["verify", str(dataset)]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert [line.split()[1].rstrip(":") for line in bad] == [names[0], names[2]]
    assert "2 ok, 2 bad" in out


@pytest.mark.parametrize("command", ["inspect", "verify", "prefetch"])
def test_missing_dataset_is_a_one_line_error(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nothing-here"
    assert main([command, str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("asynccache: error: ") and str(missing) in lines[0]
    assert "Traceback" not in captured.err


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nothing-here"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("asynccache: error:")
    assert main(["--debug", "inspect", str(tmp_path / "nothing-here")]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_bad_storage_option_is_a_one_line_error(
    dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["upload", str(dataset), "s3://b/x", "--storage-option", "novalue"]) == 2
    assert capsys.readouterr().err == (
        "asynccache: error: --storage-option expects KEY=VALUE, got 'novalue'\n"
    )


def test_storage_option_values_are_typed() -> None:
    from asynccache.cli import _storage_options

    got = _storage_options(["verify=false", "a=True", "n=42", "url=http://h:1/?x=1", "e="])
    assert got == {"verify": False, "a": True, "n": 42, "url": "http://h:1/?x=1", "e": ""}


def test_usage_error_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out


def test_upload_to_a_local_directory_url(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "dest"
    assert main(["upload", str(dataset), dest.as_uri()]) == 0
    out = capsys.readouterr().out
    assert out.startswith("uploaded 7 objects") and "0 already present" in out
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in dataset.iterdir())
    assert main(["verify", str(dest)]) == 0
    assert main(["upload", str(dataset), dest.as_uri()]) == 0
    out = capsys.readouterr().out
    # Every chunk is recorded remotely with the same checksum: skipped. The writer index
    # (no record) and the commit go again.
    assert "uploaded 2 objects" in out and "5 already present" in out  # 4 chunks, the sidecar


def test_upload_inspect_and_prefetch_through_s3(
    dataset: Path,
    tmp_path: Path,
    objstore: ObjectStore,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"s3://{bucket}/datasets/ten"
    opts = _options(objstore)
    assert main(["upload", str(dataset), url, *opts]) == 0
    assert "uploaded 7 objects" in capsys.readouterr().out

    assert main(["inspect", url, *opts]) == 0
    out = capsys.readouterr().out
    assert url in out and "items           10" in out

    cache_dir = tmp_path / "cache"
    assert main(["prefetch", url, "--cache-dir", str(cache_dir), *opts]) == 0
    out = capsys.readouterr().out
    assert out.startswith("prefetched 4 chunks"), out
    cached = {p.name for p in cache_dir.rglob("chunk-*.bin")}
    assert cached == set(_chunks(dataset))

    assert main(["prefetch", url, "--cache-dir", str(cache_dir), *opts]) == 0
    assert "prefetched 0 chunks" in capsys.readouterr().out


def test_missing_remote_dataset_is_a_one_line_error(
    objstore: ObjectStore, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{bucket}/not-there"
    assert main(["inspect", url, *_options(objstore)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("asynccache: error: ")
    assert "not-there" in err


def test_python_dash_m_inspect(dataset: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asynccache", "inspect", str(dataset)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "chunks          4" in proc.stdout


_PIN = """
import sys
from asynccache import StreamingDataset
ds = StreamingDataset(sys.argv[1], cache_dir=sys.argv[2], storage_options={opts!r})
it = iter(ds)
next(it)  # the first chunk is read, so pinned, until this process ends
print("pinned", flush=True)
sys.stdin.readline()
"""


def test_cache_ls_du_clear_keep_what_another_process_pinned(
    dataset: Path,
    tmp_path: Path,
    objstore: ObjectStore,
    bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    opts = _options(objstore)
    urls = [f"s3://{bucket}/a", f"s3://{bucket}/b"]
    cache_dir = tmp_path / "cache"
    for url in urls:
        assert main(["upload", str(dataset), url, *opts]) == 0
        assert main(["prefetch", url, "--cache-dir", str(cache_dir), *opts]) == 0
    capsys.readouterr()
    where = ["--cache-dir", str(cache_dir)]
    pinner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PIN.format(opts=objstore.storage_options),
            urls[0],
            str(cache_dir),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert pinner.stdout is not None and pinner.stdout.readline().strip() == "pinned"
        assert main(["cache", "ls", *where]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        assert sorted((r[1], r[4]) for r in rows) == [("4", "0"), ("4", "1")], rows

        assert main(["cache", "ls", "--dataset", urls[0], *where, *opts]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        assert [(r[0], r[1], r[4]) for r in rows] == [(urls[0], "4", "1")]

        total = sum(p.stat().st_size for p in cache_dir.rglob("chunk-*.bin"))
        assert main(["cache", "du", *where]) == 0
        out = capsys.readouterr().out
        assert "total in 2 dataset(s)" in out and out.count("\n") == 3

        assert main(["cache", "clear", *where]) == 0
        out = capsys.readouterr().out
        left = list(cache_dir.rglob("chunk-*.bin"))
        assert len(left) == 1 and left[0].name == _chunks(dataset)[0], "the pinned chunk"
        assert "removed 7 chunk(s)" in out and "skipped 1 file(s)" in out
        assert str(left[0]) in out, "it says what it kept"
        assert total > left[0].stat().st_size
    finally:
        pinner.communicate("\n", timeout=60)
    assert main(["cache", "clear", "--dataset", urls[0], *where, *opts]) == 0
    assert "removed 1 chunk(s)" in capsys.readouterr().out
    assert not list(cache_dir.rglob("chunk-*.bin"))
