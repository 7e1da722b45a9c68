"""Boot stamps: a durable cache publishes chunks without an fsync, and after a restart
checks again, before their first use, every chunk it cannot trust (asynccache.cache.stamp).

Real HTTP origin, real downloader and cache on this machine's file system; a restart is
played by giving the published files the stamp an earlier boot left (or none), and a
power loss that lost a chunk's blocks by zeroing part of it.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stamp_support import read_everything

from asynccache.cache import stamp
from asynccache.cache.layout import is_chunk_name, is_temp_name
from asynccache.config import Settings
from asynccache.read.reader import Reader
from asynccache.read.source import DatasetSource
from asynccache.testing.httpserver import StaticHTTPServer
from tests.helpers import noise_item, write_noise_dataset

ITEM = 4096
PER_CHUNK = 4
CHUNKS = 4
EARLIER = b"00000000-0000-4000-8000-000000000000"  # the id of a boot before this one


def _keeps_stamps(directory: Path) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"")
    try:
        return stamp.probe(probe) is not None
    finally:
        probe.unlink()


pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        stamp.boot_id() is None or not _keeps_stamps(Path(tempfile.gettempdir())),
        reason="needs a boot id and a file system with user extended attributes",
    ),
]


@pytest.fixture(scope="module")
def origin(tmp_path_factory) -> Iterator[StaticHTTPServer]:
    src = write_noise_dataset(
        tmp_path_factory.mktemp("src") / "data", PER_CHUNK * CHUNKS, PER_CHUNK, ITEM
    )
    with StaticHTTPServer(src) as server:
        yield server


def _settings(cache: Path, **kw) -> Settings:
    base = dict(
        cache_dir=str(cache),
        retries=1,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        timeout_s=10.0,
        prefetch_chunks=0,
        durable=True,
        first_read_bytes=0,
    )
    base.update(kw)
    return Settings(**base)


def _read_all(src: DatasetSource) -> None:
    """Read every item through the cache and compare it with what was written."""
    reader = Reader(src.index, src.acquire, release=src.release, ranged=None)
    try:
        for i in range(PER_CHUNK * CHUNKS):
            got = reader.read(i // PER_CHUNK, i % PER_CHUNK)
            want = noise_item(i, ITEM)
            assert got["i"] == want["i"] and np.array_equal(got["x"], want["x"]), i
    finally:
        reader.close()


def _chunks(cache: Path) -> dict[str, Path]:
    return {
        p.name: p
        for p in cache.rglob("chunk-*.bin")
        if is_chunk_name(p.name) and not is_temp_name(p.name)
    }


def _chunk_gets(origin) -> list[str]:
    return [
        r.path.rsplit("/", 1)[-1]
        for r in origin.requests
        if r.method == "GET" and r.path.rsplit("/", 1)[-1].startswith("chunk-")
    ]


class _Fsyncs:
    """Counts fsyncs of the cache's temporary chunk files (not the index sidecar's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            if is_temp_name(name) and name.startswith(".chunk-"):
                self.names.append(name)
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


def _fill(origin, cache: Path, **kw) -> dict[str, Path]:
    with DatasetSource(origin.url, settings=_settings(cache, **kw)) as src:
        _read_all(src)
    chunks = _chunks(cache)
    assert len(chunks) == CHUNKS
    return chunks


def test_a_durable_chunk_is_stamped_with_the_boot_and_not_fsynced(
    tmp_path, origin, monkeypatch
) -> None:
    fsyncs = _Fsyncs(monkeypatch)
    chunks = _fill(origin, tmp_path / "cache")
    assert fsyncs.names == []
    boot = stamp.boot_id()
    assert {name: stamp.read(p) for name, p in chunks.items()} == dict.fromkeys(chunks, boot)


def test_fsync_publish_fsyncs_each_chunk_and_marks_it_synced(tmp_path, origin, monkeypatch) -> None:
    fsyncs = _Fsyncs(monkeypatch)
    chunks = _fill(origin, tmp_path / "cache", fsync_publish=True)
    assert len(fsyncs.names) == CHUNKS
    assert {stamp.read(p) for p in chunks.values()} == {stamp.SYNCED}


def test_without_durable_nothing_is_stamped_or_fsynced(tmp_path, origin, monkeypatch) -> None:
    fsyncs = _Fsyncs(monkeypatch)
    chunks = _fill(origin, tmp_path / "cache", durable=False)
    assert fsyncs.names == []
    assert {stamp.read(p) for p in chunks.values()} == {None}


def test_where_no_stamp_can_be_written_each_chunk_is_fsynced(tmp_path, origin, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOTSUP, "no user xattrs here")

    monkeypatch.setattr(os, "setxattr", refuse)
    fsyncs = _Fsyncs(monkeypatch)
    chunks = _fill(origin, tmp_path / "cache")
    assert len(fsyncs.names) == CHUNKS
    assert {stamp.read(p) for p in chunks.values()} == {None}
    origin.requests.clear()
    with DatasetSource(origin.url, settings=_settings(tmp_path / "cache")) as src:
        _read_all(src)  # trusted as they are: fsynced
        assert src.store is not None and src.store.stamp is None  # the refusal was seen
        assert src.stats.restamped == 0
    assert _chunk_gets(origin) == []


def test_a_chunk_from_an_earlier_boot_is_checked_again_not_fetched(tmp_path, origin) -> None:
    cache = tmp_path / "cache"
    chunks = _fill(origin, cache)
    for p in chunks.values():
        os.setxattr(p, stamp.ATTR, EARLIER)
    origin.requests.clear()
    with DatasetSource(origin.url, settings=_settings(cache)) as src:
        _read_all(src)
        assert src.stats.restamped == CHUNKS
    assert _chunk_gets(origin) == []
    # Read back from the disk and matched: trusted in every later boot.
    assert {stamp.read(p) for p in chunks.values()} == {stamp.SYNCED}


def test_a_chunk_whose_blocks_a_power_loss_lost_is_fetched_again(tmp_path, origin, caplog) -> None:
    cache = tmp_path / "cache"
    chunks = _fill(origin, cache)
    name = sorted(chunks)[1]
    p = chunks[name]
    os.setxattr(p, stamp.ATTR, EARLIER)
    size = p.stat().st_size
    with open(p, "r+b") as f:  # the blocks the disk never got read back as zeros
        f.seek(size // 3)
        f.write(bytes(size // 3))
    origin.requests.clear()
    with DatasetSource(origin.url, settings=_settings(cache)) as src:
        _read_all(src)  # every item right, the damaged chunk's included
        assert src.stats.restamped == 0
    assert _chunk_gets(origin).count(name) >= 1
    assert set(_chunk_gets(origin)) == {name}
    assert stamp.read(p) == stamp.boot_id()  # the new copy, this boot's
    assert any("does not match its checksum" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_processes_starting_together_check_each_chunk_once(tmp_path, origin, method) -> None:
    # Three processes of one node start on a cache of an earlier boot at the same moment:
    # each chunk is checked once (under its download lock), by one of them, and no
    # process fetches or serves anything else.
    cache = tmp_path / "cache"
    chunks = _fill(origin, cache)
    for p in chunks.values():
        os.setxattr(p, stamp.ATTR, EARLIER)
    origin.requests.clear()
    ctx = multiprocessing.get_context(method)
    go, out = ctx.Event(), ctx.Queue()
    args = (origin.url, str(cache), PER_CHUNK * CHUNKS, PER_CHUNK, ITEM, go, out)
    procs = [ctx.Process(target=read_everything, args=args, daemon=True) for _ in range(3)]
    for proc in procs:
        proc.start()
    go.set()
    results = [out.get(timeout=90) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert all(isinstance(r, int) for r in results), results
    assert sum(results) == CHUNKS
    assert _chunk_gets(origin) == []
    assert {stamp.read(p) for p in chunks.values()} == {stamp.SYNCED}


# What a chunk may look like after a restart: (its stamp, its bytes damaged). A chunk
# stamped in this boot, or synced, cannot have lost its blocks.
_STATES = [
    ("boot", False),
    ("synced", False),
    ("earlier", False),
    ("earlier", True),
    ("none", False),
    ("none", True),
]


@pytest.fixture(scope="module")
def filled(tmp_path_factory, origin) -> Path:
    """A cache every chunk of the dataset was downloaded into (copied by each example)."""
    cache = tmp_path_factory.mktemp("filled") / "cache"
    _fill(origin, cache)
    return cache


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(states=st.lists(st.sampled_from(_STATES), min_size=CHUNKS, max_size=CHUNKS))
def test_after_a_restart_only_damaged_chunks_are_fetched_and_nothing_bad_is_served(
    filled, origin, states
) -> None:
    cache = Path(tempfile.mkdtemp(dir=filled.parent))
    shutil.copytree(filled, cache / "cache")  # stamps copied too: each is set below
    chunks = _chunks(cache / "cache")
    boot = stamp.boot_id()
    assert boot is not None
    values = {"boot": boot, "synced": stamp.SYNCED, "earlier": EARLIER, "none": None}
    for (which, damaged), name in zip(states, sorted(chunks), strict=True):
        p = chunks[name]
        value = values[which]
        if value is not None:
            os.setxattr(p, stamp.ATTR, value)
        elif stamp.read(p) is not None:
            os.removexattr(p, stamp.ATTR)
        if damaged:
            with open(p, "r+b") as f:
                f.seek(100)
                f.write(b"\0" * 64)
    origin.requests.clear()
    with DatasetSource(origin.url, settings=_settings(cache / "cache")) as src:
        _read_all(src)
        restamped = src.stats.restamped
    fetched = sorted(set(_chunk_gets(origin)))
    names = sorted(chunks)
    assert fetched == [n for n, (_, damaged) in zip(names, states, strict=True) if damaged]
    assert restamped == sum(
        1 for which, damaged in states if which in ("earlier", "none") and not damaged
    )
    after = {
        ("boot", False): boot,
        ("synced", False): stamp.SYNCED,
        ("earlier", False): stamp.SYNCED,
        ("earlier", True): boot,
        ("none", False): boot,
        ("none", True): boot,
    }
    for name, state in zip(names, states, strict=True):
        assert stamp.read(chunks[name]) == after[state], (name, state)
    shutil.rmtree(cache)
