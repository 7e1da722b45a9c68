"""A real ``aiohttp.web`` static file server on loopback, run in its own thread.

Serves one directory with ``GET`` (honouring ``Range``) and ``HEAD``, optionally over
TLS. Every request is recorded in :attr:`StaticHTTPServer.requests` so tests can see
what a client actually sent.

Invariants: binds 127.0.0.1 only, on a free port; start and stop waits are bounded;
``stop()`` (or leaving the ``with`` block) closes the server and joins its thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import ssl
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

from aiohttp import web

from .objstore import free_port

__all__ = ["RecordedRequest", "StaticHTTPServer"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it."""

    method: str
    path: str
    range: str | None


class StaticHTTPServer:
    """Serve ``directory`` at ``http(s)://127.0.0.1:<port>/``.

    Args:
        directory: the folder to serve (files below it, by relative path).
        ssl_context: serve HTTPS with this server context when given.
        timeout_s: bound on start and stop.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.directory = Path(directory)
        self.requests: list[RecordedRequest] = []
        self._ssl = ssl_context
        self._timeout_s = timeout_s
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """Base URL, without a trailing slash."""
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://127.0.0.1:{self._port}"

    def __repr__(self) -> str:
        return f"StaticHTTPServer({self.url}, {str(self.directory)!r})"

    def __enter__(self) -> StaticHTTPServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start serving; returns once the port accepts connections."""
        self._port = free_port()
        self._thread = threading.Thread(target=self._run, name="asynccache-test-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._timeout_s):
            raise RuntimeError(f"HTTP test server did not start within {self._timeout_s}s")
        if self._error is not None:
            raise RuntimeError(f"HTTP test server failed to start: {self._error!r}")

    def stop(self) -> None:
        """Stop serving and join the thread (bounded). Idempotent."""
        loop, thread = self._loop, self._thread
        self._thread = None
        if loop is None or thread is None:
            return
        if self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop)
            with contextlib.suppress(Exception):
                fut.result(self._timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(self._timeout_s)

    # -- server thread -----------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # relayed to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _serve(self) -> None:
        @web.middleware
        async def record(request: web.Request, handler: _Handler) -> web.StreamResponse:
            self.requests.append(
                RecordedRequest(request.method, request.path, request.headers.get("Range"))
            )
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_static("/", self.directory, show_index=False, follow_symlinks=False)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port, ssl_context=self._ssl)
        await site.start()
