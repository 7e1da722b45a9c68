"""Shared fixtures: a real SeaweedFS S3 server and real static HTTP servers on loopback.

* ``objstore`` (session): one :class:`asynccache.testing.ObjectStore`, started on first
  use and stopped at the end of the run.
* ``bucket`` (function): a fresh, uniquely named bucket in ``objstore``; yields its name.
* ``http_origin`` (function): a factory ``http_origin(directory) -> StaticHTTPServer``
  serving a directory over HTTP (``tls=ssl_context`` for HTTPS); every server it starts
  is stopped after the test.
"""

from __future__ import annotations

import contextlib
import ssl
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asynccache.testing import ObjectStore, StaticHTTPServer


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
