"""Shared aiohttp plumbing for the HTTP and S3 backends.

Invariants: one pooled :class:`aiohttp.ClientSession` per backend object, created lazily
on the first event loop that uses it and closed by :meth:`SessionHolder.close`; using the
backend from another loop is an error rather than a silent second pool. Redirects are
followed in one place, :func:`send_following`, which sends credentials to the request's
own origin (scheme, host, port) only; the session keeps no cookies.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from yarl import URL

from ..config import Settings
from ..errors import BridgeError, ConfigError, StorageError, TransientError
from .base import Sink, Storage
from .errmap import map_client_errors, status_error
from .wire import DirectPool

__all__ = [
    "SessionHolder",
    "Signer",
    "check_range",
    "encoded_url",
    "header_option",
    "origin_of",
    "past_end",
    "range_header",
    "receive_ranged",
    "send_following",
    "stream_body",
    "verify_tls",
]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def verify_tls(settings: Settings, options: Mapping[str, object]) -> bool:
    """TLS verification: ``storage_options['verify']`` beats ``settings.verify_tls``."""
    value = options.get("verify", settings.verify_tls)
    if isinstance(value, str):
        if value.strip().lower() in _TRUE:
            return True
        if value.strip().lower() in _FALSE:
            return False
    if not isinstance(value, bool):
        raise ConfigError(f"storage option 'verify' must be a bool, got {value!r}")
    return value


def header_option(options: Mapping[str, object], url: str) -> dict[str, str]:
    """``storage_options['headers']`` checked to be a str -> str mapping.

    Values may be secrets (bearer tokens, cookies): messages name header *names* only.
    """
    value = options.get("headers") or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"storage option 'headers' for {url} must be a dict of str to str")
    out: dict[str, str] = {}
    for name, val in value.items():
        if not isinstance(name, str) or not isinstance(val, str) or not name.strip():
            raise ConfigError(
                f"storage option 'headers' for {url}: header {name!r} must map a name "
                "to a str value"
            )
        if "\r" in val or "\n" in val or "\r" in name or "\n" in name:
            raise ConfigError(f"storage option 'headers' for {url}: header {name!r} has a newline")
        out[name] = val
    return out


def origin_of(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``url``, the port made explicit (``https://h`` is
    ``https://h:443``): what decides whether credentials may go along."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = 443 if scheme == "https" else 80
    return scheme, (parts.hostname or "").lower(), port


def _show(origin: tuple[str, str, int]) -> str:
    scheme, host, port = origin
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}"


_REDIRECTS = (301, 302, 303, 307, 308)

#: Signs the headers of one request for its URL: ``(method, href, headers) -> headers``
#: to send (credentials included). Called again for each hop of a redirect.
Signer = Callable[[str, str, Mapping[str, str]], Awaitable[Mapping[str, str]]]


async def send_following(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    what: str,
    private: Mapping[str, str] | None = None,
    sign: Signer | None = None,
    refuse_foreign: bool = False,
    data: Any = None,
    max_redirects: int = 5,
) -> aiohttp.ClientResponse:
    """Send ``method url`` and follow redirects by hand; return the final response.

    Credentials go to ``url``'s origin (scheme, host and port) only, and only until a
    redirect leaves it: ``private`` headers (tokens, cookies, the user's ``headers``)
    and what ``sign`` adds (a signature, a session token) are sent to that origin, each
    hop signed afresh for its own URL, and never to another. A hop elsewhere goes
    without them, or, with ``refuse_foreign``, is not made: a :class:`StorageError`
    names both origins (for a signed service, whose signature is valid for one host
    only, a bare request elsewhere can only fail, and a signed one would hand that
    host a credential). ``url`` and each ``Location`` are sent byte-for-byte (signed
    CDN URLs stay valid). A request with a body (``data``) is not redirected: its body
    streams once; the 3xx is returned to the caller.

    Raises:
        StorageError: a redirect to a non-HTTP URL, too many redirects, or (with
            ``refuse_foreign``) one to another origin; names ``what``.
    """
    home = origin_of(url)
    current = url
    trusted = True
    for _ in range(max_redirects + 1):
        trusted = trusted and origin_of(current) == home
        hdrs: Mapping[str, str] = dict(headers)
        if trusted:
            hdrs = {**hdrs, **(private or {})}
            if sign is not None:
                hdrs = await sign(method, current, hdrs)
        resp = await session.request(
            method, encoded_url(current), headers=hdrs, data=data, allow_redirects=False
        )
        location = resp.headers.get("Location")
        if resp.status not in _REDIRECTS or not location or data is not None:
            return resp
        resp.release()
        current = urljoin(current, location)
        if urlsplit(current).scheme not in ("http", "https"):
            raise StorageError(f"{method} {what}: redirected to a non-HTTP URL", url=what)
        if refuse_foreign and origin_of(current) != home:
            raise StorageError(
                f"{method} {what}: {_show(home)} redirected it to {_show(origin_of(current))}; "
                "not followed: the request's credentials are for the first host only (if "
                "the second is the bucket's own endpoint, give it as endpoint_url, or the "
                "bucket's region as region_name)",
                url=what,
            )
    raise StorageError(f"{method} {what}: more than {max_redirects} redirects", url=what)


class SessionHolder:
    """Owns the backend's ``ClientSession`` (connection limit, timeouts, TLS mode)."""

    def __init__(self, settings: Settings, *, verify: bool) -> None:
        self._limit = settings.max_concurrency
        self._timeout_s = settings.timeout_s
        self.receive = settings.receive
        self._direct: DirectPool | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.timeout_s,
            sock_connect=settings.timeout_s,
            sock_read=settings.timeout_s,
        )
        self.verify = verify
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ssl_mode(self) -> bool | ssl.SSLContext:
        """What the connector passes as ``ssl``: True verifies, False does not."""
        return self.verify

    def get(self) -> aiohttp.ClientSession:
        """The session for the running loop, created on first use."""
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed:
            if self._loop is not loop:
                raise BridgeError(
                    "this storage object is bound to another event loop; create one per loop"
                )
            return self._session
        connector = aiohttp.TCPConnector(limit=self._limit, ssl=self.ssl_mode)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            raise_for_status=False,
            # Cookies a server sets are not kept: a jar sends them to any port of the
            # host (cookies ignore ports), past send_following's origin rule. A cookie
            # the user needs goes in storage_options' headers, for its origin only.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._loop = loop
        return self._session

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context aiohttp's connector makes of :attr:`ssl_mode` (made once, at its
        import), so both receive paths trust exactly the same certificates."""
        made = getattr(aiohttp.connector, "_make_ssl_context", None)
        name = "_SSL_CONTEXT_VERIFIED" if self.verify else "_SSL_CONTEXT_UNVERIFIED"
        ctx = getattr(aiohttp.connector, name, None)
        if isinstance(ctx, ssl.SSLContext):
            return ctx
        if made is not None:  # pragma: no cover - another aiohttp release
            return made(self.verify)
        return ssl.create_default_context()  # pragma: no cover

    def direct(self) -> DirectPool | None:
        """The pool of our own receive path, or None when ``ASYNCCACHE_RECEIVE=aiohttp``."""
        if self.receive != "direct":
            return None
        if self._direct is None:
            self._direct = DirectPool(self._limit, self._timeout_s, self.ssl_context())
        return self._direct

    async def close(self) -> None:
        """Close the session and the direct pool's connections (idempotent)."""
        if self._direct is not None:
            await self._direct.close()
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


#: How a backend makes the GET of a range for our own receiver: ``(key, Range header)``
#: to ``(href, headers)``, the href percent-encoded (maybe signed), the headers final.
DirectRequest = Callable[[str, str], Awaitable[tuple[str, Mapping[str, str]]]]


async def receive_ranged(
    storage: Storage,
    sessions: SessionHolder,
    key: str,
    start: int,
    end: int,
    sink: Sink,
    request: DirectRequest,
    credential_source: str | None,
) -> None:
    """``receive_into`` of the S3 and HTTP backends: the bytes ``[start, end)`` of ``key``
    through our own receiver (:class:`.wire.DirectPool`), or through aiohttp's pieces
    (:meth:`Storage._receive_into_impl`'s default) when ``ASYNCCACHE_RECEIVE=aiohttp``,
    for an empty range, or when the receiver leaves the response to aiohttp (a redirect,
    a body without a length: nothing reached ``sink`` then)."""
    pool = sessions.direct()
    url = storage.object_url(key)
    check_range(start, end, url)
    if pool is not None and end != start:
        href, headers = await request(key, range_header(start, end) or "")
        if await pool.get(
            href, headers, start, end, sink, url=url, credential_source=credential_source
        ):
            return
    await Storage._receive_into_impl(storage, key, start, end, sink)


def range_header(start: int, end: int | None) -> str | None:
    """The ``Range`` header for ``[start, end)``; None for the whole object."""
    if start == 0 and end is None:
        return None
    return f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"


def past_end(resp: aiohttp.ClientResponse, start: int) -> bool:
    """True when ``resp`` is a 416 because ``start`` is at or beyond the object's end.

    Reading ``[size, ...)`` then yields nothing, as slicing (and the local backend) does.
    """
    if resp.status != 416:
        return False
    total = resp.headers.get("Content-Range", "").rpartition("/")[2]
    return total.isdigit() and start >= int(total)


def check_range(start: int, end: int | None, url: str) -> None:
    """Reject negative or inverted ranges with a ConfigError naming ``url``."""
    if start < 0 or (end is not None and end < start):
        raise ConfigError(f"invalid byte range [{start}, {end}) for {url}")


async def stream_body(
    resp: aiohttp.ClientResponse, url: str, start: int, end: int | None
) -> AsyncIterator[bytes]:
    """Yield a 200/206 body's bytes for ``[start, end)``, raising on a short body.

    A server that ignored the Range header (200 for a ranged request) is trimmed here.
    Pieces are yielded as they arrive, so a short body raises TransientError only after
    the caller has received everything that came.
    """
    skip = start if (resp.status == 200 and start > 0) else 0
    if resp.status == 200 and resp.content_length is not None:
        total = resp.content_length
        expected: int | None = max(0, (total if end is None else min(end, total)) - start)
    elif resp.content_length is not None:
        expected = resp.content_length
    else:
        expected = None if end is None else end - start
    if resp.status == 206 and end is not None and expected is not None:
        expected = min(expected, end - start)
    got = 0
    async with map_client_errors(url):
        async for piece in resp.content.iter_any():
            if skip:
                cut = min(skip, len(piece))
                piece, skip = piece[cut:], skip - cut
            if expected is not None and got + len(piece) > expected:
                piece = piece[: expected - got]
            if piece:
                got += len(piece)
                yield piece
            if expected is not None and got >= expected:
                return
    if expected is not None and got < expected:
        raise TransientError(f"GET {url}: body ended after {got} of {expected} bytes", url=url)


def encoded_url(url: str) -> URL:
    """A yarl URL that aiohttp sends byte-for-byte (it was signed that way)."""
    return URL(url, encoded=True)


async def stream_response(
    resp: aiohttp.ClientResponse,
    url: str,
    start: int,
    end: int | None,
    *,
    credential_source: str | None = None,
) -> AsyncIterator[bytes]:
    """The body of a (ranged) GET, with error statuses mapped; always frees the connection.

    A body read to the end goes back to the pool; an abandoned one is closed, never
    returned to the pool half-read.
    """
    done = False
    try:
        if past_end(resp, start):
            done = True
            return
        if resp.status not in (200, 206):
            async with map_client_errors(url):
                body = await resp.content.read(8192)
            raise status_error(
                resp.status,
                url,
                body=body,
                headers=resp.headers,
                credential_source=credential_source,
            )
        async for piece in stream_body(resp, url, start, end):
            yield piece
        done = True
    finally:
        if done:
            resp.release()
        else:
            resp.close()


async def send_small(
    session: aiohttp.ClientSession,
    method: str,
    href: str,
    *,
    what: str,
    headers: Mapping[str, str],
    data: Any = None,
    ok: tuple[int, ...] = (200,),
    credential_source: str | None = None,
    private: Mapping[str, str] | None = None,
    sign: Signer | None = None,
    refuse_foreign: bool = False,
) -> tuple[int, Any, bytes]:
    """Send one request whose answer is small and read it: ``(status, headers, body)``.

    Redirects are followed as :func:`send_following` does (credentials, ``private`` and
    what ``sign`` adds, for ``href``'s origin only). A status outside ``ok`` raises the
    mapped error naming ``what`` (the URL, never a secret). The caller wraps this in
    ``map_client_errors`` for connection failures.
    """
    resp = await send_following(
        session,
        method,
        href,
        headers=headers,
        what=what,
        private=private,
        sign=sign,
        refuse_foreign=refuse_foreign,
        data=data,
    )
    async with resp:
        body = await resp.read()
        if resp.status not in ok:
            raise status_error(
                resp.status,
                what,
                body=body,
                headers=resp.headers,
                method=method,
                credential_source=credential_source,
            )
        return resp.status, resp.headers, body


async def gather_or_cancel(coros: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run ``coros`` concurrently; on the first failure cancel the rest, wait, re-raise.

    Nothing is left running behind an error (unlike a bare ``asyncio.gather``).
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
