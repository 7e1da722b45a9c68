"""FaultProxy: a real HTTP reverse proxy on loopback that misbehaves on request.

It sits in front of an upstream base URL (a plain HTTP origin or an S3-compatible server)
and forwards every request unchanged (method, path, query, body and headers, ``Host``,
``Authorization``, ``Range`` and ``x-amz-*`` included, so SigV4 signatures still verify),
except when a programmed :class:`Fault` matches: then it answers with a 5xx or 429, resets
the connection mid-body, truncates the body below its ``Content-Length``, stalls, or flips
bytes, or trickles the body at a set rate, or answers a storm of 503 ``SlowDown`` for a
set time, or redirects to another URL. Every request is logged (method, path, Range,
arrival time) so tests can count GETs, and every fault is counted when it actually takes
effect (:meth:`FaultProxy.fired`), so a test can tell a recovered fault from one that never
fired.

Besides faults, the proxy can behave like a cloud link rather than loopback (see
:meth:`FaultProxy.set_link`): every request waits ``latency_s`` before it is forwarded
(time to first byte), and every response body is paced to at most ``conn_bytes_per_s``
(an HTTP/1.1 connection carries one response at a time, so this caps each connection).
:meth:`FaultProxy.link_fired` counts the requests each knob actually slowed down.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import aiohttp
from aiohttp import web

from ..errors import ConfigError

__all__ = ["Fault", "FaultProxy", "RequestRecord", "ServerThread"]

FaultKind = Literal[
    "status",
    "reset",
    "truncate",
    "stall",
    "slow",
    "flip",
    "trickle",
    "slowdown",
    "redirect",
    "replace",
]
LinkKnob = Literal["latency", "cap"]

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}
_PIECE = 64 << 10
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclasses.dataclass
class Fault:
    """One programmed misbehaviour, applied to the next ``times`` matching requests.

    Attributes:
        kind: ``status`` (answer ``status`` without asking upstream; with 429 and
            ``retry_after`` this is rate limiting), ``reset`` (abort the connection after
            ``after_bytes`` body bytes), ``truncate`` (close cleanly after ``after_bytes``
            while ``Content-Length`` promises more), ``stall`` (send ``after_bytes`` then
            nothing for ``stall_s``, then reset), ``slow`` (pause ``stall_s`` after
            ``after_bytes``, then finish normally), ``flip`` (XOR the byte at ``flip_at``
            with ``flip_xor``), ``trickle`` (after ``after_bytes``, send the rest at
            ``bytes_per_s``, in ten pieces a second), ``slowdown`` (answer 503 with an S3
            ``SlowDown`` XML body, and ``Retry-After`` when ``retry_after`` is set),
            ``redirect`` (answer ``status`` if it is a 3xx, else 307, with ``Location``
            ``location`` + the request's path and query, without asking upstream).
        times: how many matching requests it affects (ignored with ``for_s``).
        for_s: a storm: the fault affects every matching request from the first one
            it meets until ``for_s`` seconds later (None: ``times`` requests).
        location: the base URL a ``redirect`` points to (another server, or this
            proxy's own ``url`` for a redirect to the same origin).
        path: only requests whose path contains this string match (None: all).
        methods: only these methods match.
        range: only requests whose ``Range`` header contains this string match (None:
            any, with or without one), e.g. ``"bytes=262144-"`` for one part of a chunk.
        from_byte: only ranged requests whose range starts at or after this byte match
            (None: any), e.g. the requests a split sends for the back half of a part.
    """

    kind: FaultKind
    times: int = 1
    path: str | None = None
    methods: tuple[str, ...] = ("GET",)
    status: int = 503
    retry_after: float | None = None
    after_bytes: int = 0
    stall_s: float = 3600.0
    flip_at: int = 0
    flip_xor: int = 0xFF
    bytes_per_s: int = 1024
    range: str | None = None
    from_byte: int | None = None
    for_s: float | None = None
    location: str | None = None
    started: float | None = None  # when a storm (for_s) met its first request

    def live(self) -> bool:
        """Whether the fault still affects requests (a count left, or a storm not over)."""
        if self.for_s is None:
            return self.times > 0
        return self.started is None or time.monotonic() < self.started + self.for_s

    def matches(self, method: str, path: str, rng: str | None = None) -> bool:
        return (
            self.live()
            and method in self.methods
            and (self.path is None or self.path in path)
            and (self.range is None or (rng is not None and self.range in rng))
            and (self.from_byte is None or _range_start(rng) >= self.from_byte)
        )


def _range_start(rng: str | None) -> int:
    """The first byte of a ``bytes=S-E`` header; -1 without one (or another form)."""
    if not rng or not rng.startswith("bytes="):
        return -1
    start, _, _ = rng[len("bytes=") :].partition("-")
    return int(start) if start.isdigit() else -1


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One request the proxy received (``at``: its arrival, ``first``: when the first
    body byte was written to the client, ``ended``: when its handler returned or failed;
    0.0 until then; all ``time.monotonic()``). ``peer``: the client's port (one per
    connection: tells the requests of one connection, or of one client, apart)."""

    method: str
    path: str
    range: str | None
    fault: FaultKind | None
    at: float = 0.0
    ended: float = 0.0
    first: float = 0.0
    peer: int = 0


class ServerThread:
    """An ``aiohttp.web`` application served on a free loopback port from its own thread.

    Invariants: the thread is named and a daemon; :meth:`close` stops the site, runs the
    application's cleanup, closes the loop and joins the thread, within a bound; it is
    idempotent. ``url`` is valid between :meth:`start` and :meth:`close`.
    """

    def __init__(self, make_app: Callable[[], Awaitable[web.Application]], *, name: str) -> None:
        self._make_app = make_app
        self._name = name
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stop = asyncio.Event()
        self.url = ""

    def start(self, timeout: float = 10.0) -> str:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._serve(ready))
            except BaseException as exc:
                errors.append(exc)
                ready.set()
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"{self._name} did not start within {timeout}s")
        if errors:
            raise errors[0]
        return self.url

    async def _serve(self, ready: threading.Event) -> None:
        app = await self._make_app()
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0
        )
        await self._runner.setup()
        try:
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            host, port = self._runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
            ready.set()
            await self._stop.wait()
        finally:
            await self._runner.cleanup()

    def call_soon(self, fn: Callable[[], object]) -> None:
        self._loop.call_soon_threadsafe(fn)

    def close(self, timeout: float = 10.0) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._stop.set)
        thread.join(timeout)


class FaultProxy:
    """A reverse proxy in front of ``upstream`` that injects programmed faults.

    Usage::

        with FaultProxy(origin_url) as proxy:
            proxy.add_fault(Fault("status", times=3, status=503))
            ...  # point the client at proxy.url
            assert proxy.count("GET", "chunk-0.bin") == 1

    Invariants: faults are consumed in the order added, one per matching request; the
    request log and fault list are guarded by a lock (read them from any thread); stalls,
    latencies and paced bodies end when the proxy closes, so closing never waits on them.

    Args:
        upstream: the origin's base URL.
        latency_s: the link's time to first byte (see :meth:`set_link`).
        conn_bytes_per_s: the link's per-connection bandwidth cap; 0 means none.
    """

    def __init__(self, upstream: str, *, latency_s: float = 0.0, conn_bytes_per_s: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self._mu = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[RequestRecord] = []
        self._open = self._peak_open = 0  # requests being answered now, and the most
        self._first: dict[int, float] = {}  # log index -> first body byte sent, until ended
        self._fired: collections.Counter[FaultKind] = collections.Counter()
        self._link_fired: collections.Counter[LinkKnob] = collections.Counter()
        self._replacements: list[_Replacement] = []
        self.latency_s = 0.0
        self.conn_bytes_per_s = 0
        self.set_link(latency_s=latency_s, conn_bytes_per_s=conn_bytes_per_s)
        self._session: aiohttp.ClientSession | None = None
        self._closing: asyncio.Event | None = None
        self._server = ServerThread(self._make_app, name="asynccache-faultproxy")

    @property
    def url(self) -> str:
        return self._server.url

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> str:
        return self._server.start()

    def close(self) -> None:
        closing = self._closing
        if closing is not None:
            with contextlib.suppress(RuntimeError):
                self._server.call_soon(closing.set)
        self._server.close()

    # -- programming and inspecting ------------------------------------------------------
    def add_fault(self, fault: Fault) -> None:
        with self._mu:
            self._faults.append(fault)

    def clear_faults(self) -> None:
        with self._mu:
            self._faults.clear()

    def replace_object(self, path: str, body: bytes, *, after: int = 0) -> None:
        """Rewrite an object mid-read: once ``after`` more GETs whose path contains
        ``path`` were forwarded unchanged, every later GET and HEAD of it is answered by
        the proxy itself with ``body``, as if the object had been replaced by it: its own
        size, an ETag of its own, a ``Range`` honoured (206). Each such answer counts as
        a ``"replace"`` fault (:meth:`fired`); the faults of :meth:`add_fault` don't
        apply to them.
        """
        with self._mu:
            self._replacements.append(_Replacement(path, bytes(body), after))

    def _take_replacement(self, method: str, path: str) -> _Replacement | None:
        """The replacement that answers this request, if any (counts the GETs let through
        before it takes effect)."""
        with self._mu:
            for r in self._replacements:
                if r.path not in path or method not in ("GET", "HEAD"):
                    continue
                if r.after > 0:
                    if method == "GET":
                        r.after -= 1
                    return None
                return r
            return None

    async def _answer_replaced(
        self, request: web.Request, rng: str | None, r: _Replacement
    ) -> web.StreamResponse:
        """Answer ``request`` from the replacement's bytes, as an origin would."""
        self._fire("replace")
        total = len(r.body)
        headers = {"ETag": f'"{r.etag}"', "Content-Type": "application/octet-stream"}
        if request.method == "HEAD":
            resp = web.StreamResponse(status=200, headers=headers)
            resp.content_length = total
            await resp.prepare(request)
            return resp
        start = _range_start(rng)
        if start < 0:
            return web.Response(status=200, body=r.body, headers=headers)
        last = rng.rpartition("-")[2] if rng else ""
        end = min(total, int(last) + 1) if last.isdigit() else total
        if start >= total:
            headers["Content-Range"] = f"bytes */{total}"
            return web.Response(status=416, headers=headers)
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{total}"
        return web.Response(status=206, body=r.body[start:end], headers=headers)

    def set_link(
        self, *, latency_s: float | None = None, conn_bytes_per_s: int | None = None
    ) -> None:
        """Make the proxy behave like a slower link, for requests that arrive from now on.

        Args:
            latency_s: every request waits this long before it is forwarded: the time to
                first byte grows by it (cloud object stores: tens of milliseconds).
            conn_bytes_per_s: every response body is sent at no more than this rate, per
                response and so per connection (cloud: tens of MB/s per connection); 0
                lifts the cap. None leaves a knob as it is.
        """
        if latency_s is not None:
            if latency_s < 0:
                raise ConfigError(f"FaultProxy latency_s must be >= 0, got {latency_s}")
            self.latency_s = float(latency_s)
        if conn_bytes_per_s is not None:
            if conn_bytes_per_s < 0:
                raise ConfigError(
                    f"FaultProxy conn_bytes_per_s must be >= 0, got {conn_bytes_per_s}"
                )
            self.conn_bytes_per_s = int(conn_bytes_per_s)

    def link_fired(self, knob: LinkKnob) -> int:
        """How many requests ``knob`` actually slowed: delayed by the latency, or made to
        wait for the bandwidth cap at least once."""
        with self._mu:
            return self._link_fired[knob]

    @property
    def requests(self) -> list[RequestRecord]:
        with self._mu:
            return list(self._log)

    def fired(self, kind: FaultKind | None = None) -> int:
        """How many faults (of ``kind``; None: any) actually took effect so far.

        A fault counts when it changes what the client sees (a status sent, a byte
        flipped, a connection cut, a pause begun), not when it merely matched a request.
        """
        with self._mu:
            return sum(self._fired.values()) if kind is None else self._fired[kind]

    def _fire(self, kind: FaultKind) -> None:
        with self._mu:
            self._fired[kind] += 1

    def count(self, method: str = "GET", path: str | None = None) -> int:
        """Requests with ``method`` whose path contains ``path``."""
        return sum(
            1 for r in self.requests if r.method == method and (path is None or path in r.path)
        )

    # -- the server ----------------------------------------------------------------------
    async def _make_app(self) -> web.Application:
        self._closing = asyncio.Event()
        self._session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_read=60)
        )
        app = web.Application(client_max_size=1 << 34)
        app.router.add_route("*", "/{tail:.*}", self._handle)

        async def cleanup(_: web.Application) -> None:
            if self._session is not None:
                await self._session.close()

        app.on_cleanup.append(cleanup)
        return app

    def _take_fault(self, method: str, path: str, rng: str | None) -> Fault | None:
        with self._mu:
            for fault in self._faults:
                if fault.matches(method, path, rng):
                    if fault.for_s is None:
                        fault.times -= 1
                    elif fault.started is None:
                        fault.started = time.monotonic()
                    return dataclasses.replace(fault)
            return None

    @property
    def peak_open(self) -> int:
        """The most requests the proxy was answering at once (since it started)."""
        with self._mu:
            return self._peak_open

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        with self._mu:
            self._open += 1
            self._peak_open = max(self._peak_open, self._open)
            index = len(self._log)  # where _handle_counted logs it (no await before)
        try:
            return await self._handle_counted(request, index)
        finally:
            with self._mu:
                self._open -= 1
                first = self._first.pop(index, 0.0)
                if index < len(self._log):
                    rec = self._log[index]
                    self._log[index] = dataclasses.replace(rec, ended=time.monotonic(), first=first)

    async def _handle_counted(self, request: web.Request, index: int) -> web.StreamResponse:
        rng = request.headers.get("Range") or request.headers.get("x-ms-range")
        replaced = self._take_replacement(request.method, request.path)
        if replaced is not None:
            with self._mu:
                self._log.append(
                    RequestRecord(request.method, request.path, rng, "replace", time.monotonic())
                )
            return await self._answer_replaced(request, rng, replaced)
        fault = self._take_fault(request.method, request.path, rng)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        with self._mu:
            self._log.append(
                RequestRecord(
                    request.method,
                    request.path,
                    rng,
                    fault.kind if fault else None,
                    time.monotonic(),
                    peer=peer[1] if isinstance(peer, tuple) and len(peer) > 1 else 0,
                )
            )
        latency, cap = self.latency_s, self.conn_bytes_per_s
        if latency > 0:
            with self._mu:
                self._link_fired["latency"] += 1
            if await self._pause(latency):
                raise asyncio.CancelledError  # closing
        if fault is not None and fault.kind == "status":
            self._fire("status")
            headers = {}
            if fault.retry_after is not None:
                headers["Retry-After"] = f"{fault.retry_after:g}"
            return web.Response(status=fault.status, headers=headers, text="injected fault")
        if fault is not None and fault.kind in ("slowdown", "redirect"):
            return self._answer(request, fault)
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        body = await request.read() if request.can_read_body else None
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body,
            allow_redirects=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        ) as upstream:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_BY_HOP:
                    resp.headers.add(k, v)
            await resp.prepare(request)
            if request.method == "HEAD":
                return resp
            try:
                return await self._relay(request, resp, upstream, fault, _Pace(cap), index)
            except ConnectionResetError:
                # The client closed the connection mid-body (it cut the request short,
                # or gave up): nothing to answer, and nothing wrong with the proxy.
                raise asyncio.CancelledError from None

    def _answer(self, request: web.Request, fault: Fault) -> web.Response:
        """A ``slowdown`` or ``redirect`` answer, made here without asking upstream."""
        self._fire(fault.kind)
        if fault.kind == "redirect":
            status = fault.status if 300 <= fault.status < 400 else 307
            target = (fault.location or self.url).rstrip("/") + request.path_qs
            return web.Response(status=status, headers={"Location": target})
        headers = {"Content-Type": "application/xml"}
        if fault.retry_after is not None:
            headers["Retry-After"] = f"{fault.retry_after:g}"
        return web.Response(status=503, headers=headers, body=_SLOW_DOWN)

    async def _pause(self, delay: float) -> bool:
        """Sleep ``delay`` seconds, or less if the proxy closes; True when it closes."""
        assert self._closing is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closing.wait(), delay)
        return self._closing.is_set()

    async def _send(self, resp: web.StreamResponse, piece: bytes, pace: _Pace) -> None:
        """Write ``piece``, at no more than the cap when there is one."""
        if not pace.rate:
            await resp.write(piece)
            return
        i = 0
        while i < len(piece):
            part = piece[i : i + pace.step()]
            i += len(part)
            delay = pace.due(len(part))  # a link at this rate delivers it no sooner
            if delay > 0:
                if not pace.waited:
                    pace.waited = True
                    with self._mu:
                        self._link_fired["cap"] += 1
                if await self._pause(delay):
                    raise asyncio.CancelledError  # closing: stop feeding the client
            await resp.write(part)

    async def _relay(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        fault: Fault | None,
        pace: _Pace,
        index: int,
    ) -> web.StreamResponse:
        sent = 0
        body = upstream.content
        pieces = body.iter_chunked(_PIECE) if fault is not None else body.iter_any()
        async for piece in pieces:
            if not sent:
                with self._mu:
                    self._first.setdefault(index, time.monotonic())
            if (
                fault is not None
                and fault.kind == "flip"
                and sent <= fault.flip_at < sent + len(piece)
            ):
                i = fault.flip_at - sent
                piece = piece[:i] + bytes([piece[i] ^ fault.flip_xor]) + piece[i + 1 :]
                self._fire("flip")
            if fault is not None and fault.kind == "trickle":
                sent = await self._trickle(resp, piece, sent, fault)
                continue
            if fault is not None and fault.kind in ("reset", "truncate", "stall", "slow"):
                room = fault.after_bytes - sent
                if fault.kind == "slow" and 0 <= room < len(piece):
                    await resp.write(piece[:room])
                    self._fire("slow")
                    await asyncio.sleep(fault.stall_s)
                    piece, sent = piece[room:], sent + room
                    fault = None
                elif room < len(piece):
                    if room > 0:
                        await resp.write(piece[:room])
                        sent += room
                    return await self._misbehave(request, resp, fault)
            await self._send(resp, piece, pace)
            sent += len(piece)
        await resp.write_eof()
        return resp

    async def _trickle(
        self, resp: web.StreamResponse, piece: bytes, sent: int, fault: Fault
    ) -> int:
        """Send ``piece``: at full speed up to ``after_bytes``, then ``bytes_per_s``."""
        fast = max(0, min(len(piece), fault.after_bytes - sent))
        if fast:
            await resp.write(piece[:fast])
        step = max(1, fault.bytes_per_s // 10)
        assert self._closing is not None
        for i in range(fast, len(piece), step):
            if i == fast and sent + fast == fault.after_bytes:
                self._fire("trickle")
            await resp.write(piece[i : i + step])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), 0.1)
            if self._closing.is_set():
                raise asyncio.CancelledError  # closing: stop feeding the client
        return sent + len(piece)

    async def _misbehave(
        self, request: web.Request, resp: web.StreamResponse, fault: Fault
    ) -> web.StreamResponse:
        self._fire(fault.kind)
        transport = request.transport
        if transport is not None:
            await _flushed(transport)  # the bytes before the fault really reach the client
        if fault.kind == "stall":
            assert self._closing is not None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), fault.stall_s)
        if transport is not None:
            if fault.kind == "truncate":
                transport.close()  # a clean FIN, fewer bytes than Content-Length promised
            else:
                transport.abort()  # a reset (and the end of a stall)
        raise asyncio.CancelledError  # the response cannot be finished: drop the handler


@dataclasses.dataclass
class _Replacement:
    """An object's new bytes, served once ``after`` more GETs were let through."""

    path: str
    body: bytes
    after: int

    @property
    def etag(self) -> str:
        return hashlib.md5(self.body, usedforsecurity=False).hexdigest()


class _Pace:
    """The pacing of one response body at ``rate`` bytes/s (0: none): byte ``k`` leaves no
    sooner than ``k / rate`` seconds after the body started, as over a link of that rate."""

    __slots__ = ("rate", "sent", "start", "waited")

    def __init__(self, rate: int) -> None:
        self.rate, self.sent, self.start, self.waited = rate, 0, 0.0, False

    def step(self) -> int:
        """Bytes to send in the next write: 1 ms worth for a body's first (a write leaves
        when its last byte is due, so a larger first write would hold the first byte back
        for the whole write: a first-byte wait the link does not have), then 50 ms worth."""
        return max(1, self.rate // (1000 if not self.sent else 20))

    def due(self, nbytes: int) -> float:
        """Count ``nbytes`` as sent; the seconds to wait before sending more."""
        now = time.monotonic()
        if not self.sent:
            self.start = now
        self.sent += nbytes
        return self.start + self.sent / self.rate - now


async def _flushed(transport: asyncio.BaseTransport, timeout: float = 2.0) -> None:
    """Wait (bounded) until the kernel has taken every buffered byte of ``transport``."""
    deadline = asyncio.get_running_loop().time() + timeout
    get_size = getattr(transport, "get_write_buffer_size", None)
    while get_size is not None and get_size() > 0 and not transport.is_closing():
        if asyncio.get_running_loop().time() > deadline:
            return
        await asyncio.sleep(0.005)
