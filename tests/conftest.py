"""Shared fixtures: a real SeaweedFS S3 server and real static HTTP servers on loopback.

* ``objstore`` (session): one :class:`asynccache.testing.ObjectStore`, started on first
  use and stopped at the end of the run.
* ``bucket`` (function): a fresh, uniquely named bucket in ``objstore``; yields its name.
* ``http_origin`` (function): a factory ``http_origin(directory) -> StaticHTTPServer``
  serving a directory over HTTP (``tls=ssl_context`` for HTTPS); every server it starts
  is stopped after the test.

Every temporary file of a run (ours, ``multiprocessing``'s, the object store's sockets, in
this process and every child, which inherit ``TMPDIR``) goes under one directory per run,
removed at the end. Each test is checked for temporary files of the library that outlive
it (an upload's temp file, an ``optimize`` staging directory, a store's directory): a
test that leaves one fails, naming it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import tempfile
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import util as mp_util
from pathlib import Path

import pytest

from asynccache.testing import ObjectStore, StaticHTTPServer

# Names the library and its test servers give their temporary files and directories.
_OURS = ("asynccache-", "optimize-shards-", "seaweedfs-")
_RUN_TMP: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    """Point ``TMPDIR`` at a directory of this run, so leftovers are ours to see and remove."""
    if "run" in _RUN_TMP:
        return
    run = tempfile.mkdtemp(prefix="asynccache-tests-")
    _RUN_TMP.update(run=run, before=os.environ.get("TMPDIR", ""))
    os.environ["TMPDIR"] = run
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    run = _RUN_TMP.pop("run", None)
    if run is None:
        return
    before = _RUN_TMP.pop("before")
    if before:
        os.environ["TMPDIR"] = before
    else:
        os.environ.pop("TMPDIR", None)
    tempfile.tempdir = None
    # Removed last, after multiprocessing's own exit finalizers (priority -100) have removed
    # the pymp-* directories this process made in it.
    mp_util.Finalize(
        None, shutil.rmtree, args=(run,), kwargs={"ignore_errors": True}, exitpriority=-200
    )


def _leftovers() -> set[str]:
    run = _RUN_TMP.get("run")
    if run is None:
        return set()
    return {name for name in os.listdir(run) if name.startswith(_OURS)}


@pytest.fixture(autouse=True)
def _no_leftover_temp_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves temporary files of the library behind (names above)."""
    before = _leftovers()
    yield
    store = request.session.__dict__.get("_asynccache_objstore")
    root = store.root if store is not None else None
    left = _leftovers() - before - ({root.name} if root is not None else set())
    if left:
        pytest.fail(f"temporary files left behind: {sorted(left)}", pytrace=False)


@pytest.fixture(scope="session")
def objstore(request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    """One SeaweedFS S3 server for the whole run."""
    with ObjectStore() as store:
        request.session.__dict__["_asynccache_objstore"] = store
        yield store
        request.session.__dict__.pop("_asynccache_objstore", None)


@pytest.fixture
def bucket(objstore: ObjectStore) -> Iterator[str]:
    """A fresh bucket, deleted (with its contents) after the test."""
    name = f"t-{uuid.uuid4().hex[:16]}"
    objstore.create_bucket(name)
    yield name
    with contextlib.suppress(Exception):
        objstore.delete_bucket(name)


HttpOrigin = Callable[..., StaticHTTPServer]


@pytest.fixture
def http_origin() -> Iterator[HttpOrigin]:
    """Factory: ``http_origin(directory, tls=None)`` starts a static server on loopback."""
    started: list[StaticHTTPServer] = []

    def start(directory: str | Path, tls: ssl.SSLContext | None = None) -> StaticHTTPServer:
        server = StaticHTTPServer(directory, ssl_context=tls)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
