"""Shared fixtures: a real SeaweedFS S3 server and real static HTTP servers on loopback.

* ``objstore`` (session): one :class:`asynccache.testing.ObjectStore`, started on first
  use and stopped at the end of the run.
* ``bucket`` (function): a fresh, uniquely named bucket in ``objstore``; yields its name.
* ``http_origin`` (function): a factory ``http_origin(directory) -> StaticHTTPServer``
  serving a directory over HTTP (``tls=ssl_context`` for HTTPS); every server it starts
  is stopped after the test.

Every temporary file of a run (ours, ``multiprocessing``'s, the object store's sockets, in
this process and every child, which inherit ``TMPDIR``) goes under one directory per run,
removed at the end. Temporary files of the library that outlive every test and fixture
(an upload's temp file, an ``optimize`` staging directory, a server's directory) fail
the run, each named with the test during which it appeared. With ``pytest -n N``
(pytest-xdist, as ``make test`` runs it) each worker process has its own directory (inside
the controller's) and its own servers, and reports what it found left behind to the
controller, which fails the run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import ssl
import tempfile
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import util as mp_util
from pathlib import Path

import pytest

from asynccache.download import link
from asynccache.testing import ObjectStore, StaticHTTPServer

# What the run's one fork server imports before it forks anything. multiprocessing keeps one
# fork server per process, started by the first test that needs one with the preload list
# of that moment; later lists are ignored. The gloo tests fork their ranks from it and name
# their rank modules (torch.distributed) for it, but in a whole run a test of another area
# starts it first, and each rank imported torch itself (test_ddp: 2-4x slower). Set once,
# before any test: optimize's pool preload and the modules those ranks run.
_FORKSERVER_PRELOAD = [
    "__main__",
    "asynccache.optimize.api",
    "torch.distributed",
    "tests.distributed.ranks",
    "tests.distributed.budget_ranks",
    "tests.distributed.mix_ranks",
    "tests.tokens.ranks",
    "tests.optimize.ranks",
]

# Names the library and its test servers give their temporary files and directories.
_OURS = ("asynccache-", "optimize-shards-", "seaweedfs-")
# A run's own directory (pytest_configure); an xdist worker's lies in the controller's.
_RUN_PREFIX = "asynccache-tests-"
_RUN_TMP: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    """Point ``TMPDIR`` at a directory of this run, so leftovers are ours to see and remove."""
    if "run" in _RUN_TMP:
        return
    multiprocessing.set_forkserver_preload(_FORKSERVER_PRELOAD)
    run = tempfile.mkdtemp(prefix=_RUN_PREFIX)
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
    return {
        name
        for name in os.listdir(run)
        if name.startswith(_OURS) and not name.startswith(_RUN_PREFIX)
    }


# Each temporary entry of ours, by the test during which it appeared.
_BORN: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _note_temp_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """Note which test made each temporary file of the library (names above)."""
    before = _leftovers()
    yield
    for name in _leftovers() - before:
        _BORN.setdefault(name, request.node.nodeid)


# What the xdist workers reported left behind (in the controller).
_WORKERS_LEFT: list[str] = []


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to a run without it
def pytest_testnodedown(node: object, error: object) -> None:
    """An xdist worker is done: keep what it reported left behind (controller only)."""
    output = getattr(node, "workeroutput", None) or {}
    _WORKERS_LEFT.extend(output.get("asynccache_leftovers", []))


@pytest.fixture(autouse=True)
def _fresh_links() -> None:
    """Each test measures its own links: a loopback port that an earlier test's server had
    (now another server's) must not carry that server's first-byte waits into this test
    (the process's link estimates are kept per endpoint, ``download/link.py``)."""
    link.forget()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if temporary files of the library outlive every test and fixture
    (servers of a module or of the run included: they are stopped by now). An xdist
    worker hands its findings to the controller (``workeroutput``), which fails the run."""
    lines = [
        f"  {name}  (appeared during {_BORN.get(name, 'no test')})" for name in sorted(_leftovers())
    ]
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["asynccache_leftovers"] = lines
        return
    lines += _WORKERS_LEFT
    if not lines:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "temporary files left behind", red=True)
        reporter.write_line("\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def objstore() -> Iterator[ObjectStore]:
    """One SeaweedFS S3 server for the whole run."""
    with ObjectStore() as store:
        yield store


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
