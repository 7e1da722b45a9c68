"""Our own HTTP/1.1 GET receiver for ranged object bodies (the S3 and HTTP backends).

aiohttp hands a body over as a new ``bytes`` per socket read, through its parser and a
stream reader the consumer awaits piece by piece. For chunk parts (megabytes each) that
cost most of the client's CPU after the copies themselves. Here a connection is an
:class:`asyncio.BufferedProtocol`: the kernel copies each read straight into one buffer the
connection reuses, and the bytes go on to the caller's :class:`~.base.Sink` from the
protocol callback, with no per-piece object, parser or task wake-up. Only the response head
is parsed (status line, headers, ``Content-Length``).

Anything unusual is left to aiohttp: :meth:`DirectPool.get` returns False before any body
byte reaches the sink (a redirect, ``Transfer-Encoding: chunked`` or a 2xx without a
length, an error status without a length), and the backend sends the request again
through its aiohttp session. Error statuses with a length are read (8 KiB kept) and mapped
by :func:`~.errmap.status_error`, exactly as the aiohttp path maps them.

Invariants:
    * A redirect is never followed here: the request's headers may carry credentials
      for its own origin only, and which may go where is decided in one place
      (:func:`.transport.send_following`, on the aiohttp path the 3xx is handed to).
    * A connection carries one request at a time and returns to the pool only after its
      response was read to its last byte with keep-alive; a cut, an error or a
      cancellation closes it (``abort``), never drains it.
    * No byte past the request's range, nor past ``Content-Length``, is handed to the sink.
    * Every wait is bounded: connect and TLS handshake by ``timeout_s``, the response by a
      timer that fails it after ``timeout_s`` without a byte.
    * The pool is bound to the event loop that first used it. In a forked child it forgets
      the parent's connections (kept referenced, never used or closed there).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

from multidict import CIMultiDict

from ..bridge import forksafe
from ..errors import BridgeError, StorageError, StorageTimeoutError, TransientError
from .base import Sink
from .errmap import map_socket_errors, status_error

__all__ = ["DirectPool"]

#: Bytes received per read, into the one buffer all connections of a pool share: the
#: protocol callbacks run one at a time on the loop, and each hands its bytes on (or keeps
#: a copy: a response head cut across reads) before it returns.
RECV_BYTES = 1 << 20
_MAX_HEAD = 64 << 10
_ERROR_BODY = 8192
_abandoned: list[object] = []  # connections inherited over fork: never closed in the child

_IDLE, _HEAD, _BODY, _ERRBODY, _DONE = range(5)


class _Result:
    __slots__ = ("fallback",)

    def __init__(self, fallback: bool) -> None:
        self.fallback = fallback


class _Conn(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection; reads into the pool's buffer and forwards body bytes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, buf: bytearray) -> None:
        self.loop = loop
        self.buf = buf
        self.mv = memoryview(buf)
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.state = _IDLE
        self.reusable = False
        self.used = 0  # requests answered on this connection
        self.any_byte = False  # whether the last request got any answer
        self._timer: asyncio.TimerHandle | None = None
        self._reset_request()

    def _reset_request(self) -> None:
        self.waiter: asyncio.Future[_Result] | None = None
        self.sink: Sink | None = None
        self.url = ""
        self.start = 0
        self.end = 0
        self.credential_source: str | None = None
        self.partial = bytearray()  # a response head cut across reads, so far
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.wire_left = 0  # body bytes on the wire still to read (Content-Length)
        self.skip = 0  # leading body bytes to drop (a 200 to a ranged request)
        self.want = 0  # body bytes still to hand to the sink
        self.expected = 0
        self.got = 0
        self.keep_alive = False
        self.err_body = bytearray()
        self.err_mode = "length"
        self.last = 0.0

    # -- asyncio.BufferedProtocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state in (_BODY, _ERRBODY) and 0 < self.wire_left < len(self.mv):
            return self.mv[: self.wire_left]  # never read into the next response
        return self.mv

    def buffer_updated(self, nbytes: int) -> None:
        self.last = self.loop.time()
        self.any_byte = True
        try:
            if self.state == _BODY:
                self._body(self.mv[:nbytes])
            elif self.state == _HEAD:
                self._head(nbytes)
            elif self.state == _ERRBODY:
                self._error_body(self.mv[:nbytes])
            else:  # bytes nobody asked for: the connection is not usable any more
                self.reusable = False
                self._abort()
        except Exception as exc:  # the sink's own error (a full disk) ends the request
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.reusable = False
        if self.state in (_IDLE, _DONE) or self.waiter is None or self.waiter.done():
            return
        if self.state == _ERRBODY:  # the status says what failed: map what came of the body
            self._error_body(memoryview(b""), closed=True)
            return
        if self.state == _BODY:
            if exc is not None:
                err = TransientError(f"GET {self.url}: body cut short ({exc!r})", url=self.url)
            else:
                err = TransientError(
                    f"GET {self.url}: body ended after {self.got} of {self.expected} bytes",
                    url=self.url,
                )
        else:
            why = repr(exc) if exc is not None else "server disconnected"
            err = TransientError(f"GET {self.url}: connection failed ({why})", url=self.url)
        if exc is not None:
            err.__cause__ = exc
        self._fail(err)

    # -- one request -----------------------------------------------------------------
    async def run(
        self,
        request: bytes,
        sink: Sink,
        url: str,
        start: int,
        end: int,
        timeout_s: float,
        credential_source: str | None,
    ) -> _Result:
        """Send ``request`` and feed the body of ``[start, end)`` to ``sink``."""
        assert self.transport is not None
        self.waiter = self.loop.create_future()
        self.sink, self.url, self.start, self.end = sink, url, start, end
        self.credential_source = credential_source
        self.state = _HEAD
        self.reusable = False
        self.any_byte = False
        self.last = self.loop.time()
        self._timer = self.loop.call_later(timeout_s, self._check_idle, timeout_s)
        try:
            self.transport.write(request)
            return await self.waiter
        finally:
            self._timer.cancel()
            if self.state != _DONE:
                self.reusable = False
            self.state = _IDLE if self.reusable else _DONE
            if not self.reusable:
                self._abort()
            self.used += 1
            self._reset_request()

    def _check_idle(self, timeout_s: float) -> None:
        if self.waiter is None or self.waiter.done():
            return
        idle = self.loop.time() - self.last
        if idle >= timeout_s:
            self._fail(StorageTimeoutError(f"GET {self.url} timed out", url=self.url))
            return
        self._timer = self.loop.call_later(timeout_s - idle, self._check_idle, timeout_s)

    def _head(self, nbytes: int) -> None:
        if self.partial:  # the head began in an earlier read
            self.partial += self.mv[:nbytes]
            at = self.partial.find(b"\r\n\r\n")
            data, filled = memoryview(self.partial), len(self.partial)
        else:
            at = self.buf.find(b"\r\n\r\n", 0, nbytes)
            data, filled = self.mv, nbytes
        if at < 0:
            if filled >= _MAX_HEAD:
                raise TransientError(f"GET {self.url}: response head too long", url=self.url)
            if not self.partial:
                self.partial = bytearray(self.mv[:nbytes])  # the shared buffer is reused
            return
        head = bytes(data[:at])
        rest = bytes(data[at + 4 : filled]) if self.partial else data[at + 4 : filled]
        self.partial = bytearray()
        self._parse(head)
        if self.state == _DONE:
            return
        if rest:
            if self.state == _BODY:
                self._body(memoryview(rest))
            else:
                self._error_body(memoryview(rest))
        elif self.state == _BODY and self.want <= 0:
            self._finish(_Result(False))

    def _parse(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest.partition(" ")[0]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise TransientError(f"GET {self.url}: malformed response {lines[0]!r}", url=self.url)
        self.status = status = int(code)
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers.add(name.strip(), value.strip())
        conn = headers.get("Connection", "").lower()
        self.keep_alive = "close" not in conn and (version != "HTTP/1.0" or "keep-alive" in conn)
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        length = headers.get("Content-Length")
        size = int(length) if length is not None and length.isdigit() else None
        if 100 <= status < 200 or status in (301, 302, 303, 307, 308):
            self._finish(_Result(True))  # left to aiohttp (it follows redirects)
            return
        if status == 416:
            total = headers.get("Content-Range", "").rpartition("/")[2]
            if total.isdigit() and self.start >= int(total):
                self._finish(_Result(False))  # past the end: nothing, as slicing gives
                return
        if status not in (200, 206):
            # An error: read its (small) body to map it; framed by length, chunks or close.
            self.err_mode = "length" if size is not None and not chunked else "chunked"
            if size is None and not chunked:
                self.err_mode = "close"
            self.wire_left = size if size is not None and self.err_mode == "length" else _MAX_HEAD
            self.state = _ERRBODY
            if self.wire_left == 0:
                self._error_body(memoryview(b""))
            return
        if chunked or size is None:
            self._finish(_Result(True))  # a body without a length: left to aiohttp
            return
        self.wire_left = size
        self.skip = self.start if status == 200 and self.start > 0 else 0
        if status == 200:
            want = max(0, min(self.end, size) - self.start)
        else:
            want = min(size, self.end - self.start)
        self.want = self.expected = want
        self.state = _BODY

    def _body(self, data: memoryview) -> None:
        n = len(data)
        self.wire_left -= n
        if self.skip:
            cut = min(self.skip, n)
            data, self.skip = data[cut:], self.skip - cut
        if len(data) > self.want:
            data = data[: self.want]
        more = True
        if data:
            self.want -= len(data)
            self.got += len(data)
            assert self.sink is not None
            more = self.sink.write(data)
        if self.want <= 0:
            self.reusable = self.keep_alive and self.wire_left == 0
            self._finish(_Result(False))
        elif not more or self.wire_left <= 0:
            if self.wire_left <= 0:  # the server's length promised less than we asked
                raise TransientError(
                    f"GET {self.url}: body ended after {self.got} of {self.expected} bytes",
                    url=self.url,
                )
            self._finish(_Result(False))  # a cut: the sink wants no more (no reuse)

    def _error_body(self, data: memoryview, *, closed: bool = False) -> None:
        """Collect an error response's body (at most 64 KiB on the wire), then raise the
        mapped error with its first 8 KiB, as the aiohttp path reads them."""
        self.wire_left -= len(data)
        self.err_body += data
        mode = self.err_mode
        raw = bytes(self.err_body)
        if mode == "length":
            done = self.wire_left <= 0
            body = raw
        elif mode == "chunked":
            body, done = _dechunk(raw)
        else:
            body, done = raw, False
        if not (done or closed or self.wire_left <= 0):
            return
        self.reusable = done and self.keep_alive and mode == "length" and self.wire_left == 0
        self._fail(
            status_error(
                self.status,
                self.url,
                body=body[:_ERROR_BODY],
                headers=self.headers,
                credential_source=self.credential_source,
            ),
            done=True,
        )

    def _finish(self, result: _Result) -> None:
        self.state = _DONE
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(result)

    def _fail(self, exc: BaseException, *, done: bool = False) -> None:
        if not done:
            self.reusable = False
        self.state = _DONE
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if not self.reusable:
            self._abort()

    def _abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.abort()
        self.lost = True


def _dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The payload of a chunked body read so far, and whether its last chunk arrived."""
    out = bytearray()
    at = 0
    while True:
        eol = raw.find(b"\r\n", at)
        if eol < 0:
            return bytes(out), False
        size_text = raw[at:eol].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            return bytes(out), True  # malformed: map what we have
        if size == 0:
            return bytes(out), True
        out += raw[eol + 2 : eol + 2 + size]
        if eol + 2 + size + 2 > len(raw):
            return bytes(out), False
        at = eol + 2 + size + 2


_Origin = tuple[str, str, int]


class DirectPool:
    """Keep-alive connections per origin for :meth:`get`, at most ``limit`` in use at once.

    Args:
        limit: connections in use at once (the aiohttp connector's limit).
        timeout_s: bound on connecting, the TLS handshake, and a response without a byte.
        ssl_context: the TLS context for ``https`` (the one the aiohttp session uses).
    """

    def __init__(self, limit: int, timeout_s: float, ssl_context: ssl.SSLContext | None) -> None:
        self._limit = limit
        self._timeout_s = timeout_s
        self._ssl = ssl_context
        self._idle: dict[_Origin, list[_Conn]] = {}
        self._buf = bytearray(RECV_BYTES)  # every connection's reads (see RECV_BYTES)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None
        self.connects = 0  # connections opened (for tests and stats)
        self.handed_back = 0  # requests left to aiohttp (a redirect, no length...)
        forksafe.register(self)

    def idle(self) -> int:
        """Connections waiting in the pool for their next request."""
        return sum(len(v) for v in self._idle.values())

    async def get(
        self,
        href: str,
        headers: Mapping[str, str],
        start: int,
        end: int,
        sink: Sink,
        *,
        url: str,
        credential_source: str | None = None,
    ) -> bool:
        """GET the bytes ``[start, end)`` of ``href`` into ``sink``; False: not handled here.

        ``href`` is sent byte-for-byte as given (already percent-encoded, maybe signed);
        ``headers`` are sent as given (plus ``Host``). False means nothing reached the
        sink and the caller must send the request another way.

        Raises:
            TransientError: reset, refused, short body, 5xx/429 (mapped as errmap does).
            StorageTimeoutError: no connection or no byte within ``timeout_s``.
            StorageError: other statuses, a rejected TLS certificate.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._sem = loop, asyncio.Semaphore(self._limit)
        elif self._loop is not loop:
            raise BridgeError(
                "this storage object is bound to another event loop; create one per loop"
            )
        assert self._sem is not None
        parts = urlsplit(href)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            return False
        default = 443 if scheme == "https" else 80
        port = parts.port or default
        host = parts.hostname
        netloc = f"[{host}]" if ":" in host else host
        if port != default:
            netloc += f":{port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"GET {target} HTTP/1.1", f"Host: {netloc}"]
        lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "host"]
        if not any(k.lower() == "accept-encoding" for k in headers):
            lines.append("Accept-Encoding: identity")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        origin = (scheme, host, port)
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._sem.acquire()
        except TimeoutError:
            raise StorageTimeoutError(
                f"GET {url}: no connection free within {self._timeout_s}s", url=url
            ) from None
        try:
            for attempt in range(2):
                conn = self._take(origin) if attempt == 0 else None
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(origin, url)
                try:
                    result = await conn.run(
                        request, sink, url, start, end, self._timeout_s, credential_source
                    )
                except TransientError as exc:
                    if reused and not conn.any_byte and not isinstance(exc, StorageTimeoutError):
                        continue  # the server closed an idle connection: once more, afresh
                    raise
                finally:
                    if conn.reusable and not conn.lost:
                        idle = self._idle.setdefault(origin, [])
                        if len(idle) < self._limit:
                            idle.append(conn)
                        else:
                            conn._abort()
                if result.fallback:
                    self.handed_back += 1
                return not result.fallback
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            self._sem.release()

    def _take(self, origin: _Origin) -> _Conn | None:
        conns = self._idle.get(origin)
        while conns:
            conn = conns.pop()
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, origin: _Origin, url: str) -> _Conn:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self._ssl if scheme == "https" else None
        if scheme == "https" and tls is None:
            raise StorageError(f"GET {url}: no TLS context for https", url=url)
        async with map_socket_errors(url):
            async with asyncio.timeout(self._timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, self._buf),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                    ssl_handshake_timeout=self._timeout_s if tls is not None else None,
                )
        self.connects += 1
        return conn

    async def close(self) -> None:
        """Close every idle connection (idempotent)."""
        idle, self._idle = self._idle, {}
        self._loop = self._sem = None  # a later use may come from another loop, as aiohttp's
        for conns in idle.values():
            for conn in conns:
                conn._abort()

    def _after_fork_in_child(self) -> None:
        # The sockets are the parent's: keep them referenced (never closed here) and
        # start empty, on whatever loop the child uses first.
        _abandoned.append(self._idle)
        self._idle = {}
        self._loop = None
        self._sem = None
