"""Translation of transport failures into the :mod:`asynccache.errors` storage tree.

The one place where aiohttp exceptions and HTTP status codes become asynccache errors,
so every backend maps them the same way:

===========================================  ==========================================
cause                                         raised
===========================================  ==========================================
404, ``NoSuchKey``, ``BlobNotFound``...       :class:`ObjectNotFoundError`
401, 403, ``AuthenticationFailed``...         :class:`AuthError` (names the credential
                                              source, never the secret)
429, 503, ``SlowDown``, ``ServerBusy``...     :class:`ThrottledError` (a TransientError
                                              waited out with a patience in seconds, see
                                              :mod:`asynccache.download.retry`)
408, other 5xx, ``InternalError``...          :class:`TransientError`
                                              (both: ``retry_after`` from
                                              ``Retry-After``, ``retry-after-ms`` or
                                              ``x-ms-retry-after-ms``)
reset, refused, payload error, short body     :class:`TransientError`
timeout                                       :class:`StorageTimeoutError`
TLS certificate rejected                      :class:`StorageError` (not retried)
any other status                              :class:`StorageError`
===========================================  ==========================================

The error code comes from an XML ``<Code>`` in the body (S3, Azure) or, for bodiless
answers such as HEAD, from Azure's ``x-ms-error-code`` or the Hub's ``X-Error-Code``
header.
"""

from __future__ import annotations

import asyncio
import email.utils
import ssl
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import aiohttp

from ..errors import (
    AuthError,
    ObjectNotFoundError,
    StorageError,
    StorageTimeoutError,
    ThrottledError,
    TransientError,
)

__all__ = [
    "error_code",
    "map_client_errors",
    "map_socket_errors",
    "parse_retry_after",
    "status_error",
]

_NOT_FOUND_CODES = frozenset(
    {
        "NoSuchKey",
        "NoSuchBucket",
        "NoSuchUpload",
        "NotFound",
        "BlobNotFound",
        "ContainerNotFound",
        "ResourceNotFound",
        "EntryNotFound",
        "RevisionNotFound",
    }
)
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "NoAuthenticationInformation",
        "InvalidAuthenticationInfo",
        "GatedRepo",
    }
)
_REGION_CODES = frozenset(
    {"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"}
)
# The service asks the client to slow down (S3, Azure, GCS and S3-compatible stores).
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "ServerBusy",
        "TooManyRequests",
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "rateLimitExceeded",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "ServerBusy",
        "OperationTimedOut",
    }
)


def error_code(body: bytes) -> str | None:
    """The ``<Code>`` of an S3 XML error body, or None when there is none."""
    if not body.lstrip().startswith(b"<"):
        return None
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return None
    for el in root.iter():
        if el.tag.rsplit("}", 1)[-1] == "Code" and el.text:
            return el.text.strip()
    return None


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date), else None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def status_error(
    status: int,
    url: str,
    *,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    method: str = "GET",
    credential_source: str | None = None,
) -> StorageError:
    """The storage error for an unexpected HTTP ``status`` on ``url``."""
    hdrs = headers or {}
    code = error_code(body) or hdrs.get("x-ms-error-code") or hdrs.get("X-Error-Code")
    what = f"{method} {url} -> HTTP {status}" + (f" {code}" if code else "")
    if status == 404 or code in _NOT_FOUND_CODES:
        return ObjectNotFoundError(f"not found: {what}", url=url)
    if status in (401, 403) or code in _AUTH_CODES:
        source = f" (credentials from {credential_source})" if credential_source else ""
        return AuthError(f"access denied: {what}{source}", url=url)
    if status in (429, 503) or code in _THROTTLE_CODES:
        # 503 from S3-compatible stores is how they throttle, with or without SlowDown.
        return ThrottledError(
            f"throttled: {what}", url=url, retry_after=_retry_after(headers or {})
        )
    if status in (408, 429) or status >= 500 or code in _TRANSIENT_CODES:
        retry_after = _retry_after(headers or {})
        return TransientError(f"server busy or failing: {what}", url=url, retry_after=retry_after)
    hint = " (is region_name right for this bucket?)" if code in _REGION_CODES else ""
    return StorageError(f"unexpected response: {what}{hint}", url=url)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """The server's requested delay: ``Retry-After``, or Azure's millisecond headers."""
    for name in ("x-ms-retry-after-ms", "retry-after-ms"):
        value = headers.get(name)
        if value:
            try:
                return max(0.0, float(value) / 1000.0)
            except ValueError:
                pass
    return parse_retry_after(headers.get("Retry-After"))


@asynccontextmanager
async def map_client_errors(url: str, method: str = "GET") -> AsyncIterator[None]:
    """Translate aiohttp/OS/timeout exceptions raised inside the block, naming ``url``.

    asynccache errors pass through unchanged.
    """
    try:
        yield
    except StorageError:
        raise
    except aiohttp.ClientConnectorCertificateError as exc:
        raise StorageError(
            f"TLS certificate of {url} was rejected ({exc.certificate_error}); pass "
            "storage_options={'verify': False} or ASYNCCACHE_VERIFY_TLS=0 to trust it",
            url=url,
        ) from exc
    except aiohttp.ClientSSLError as exc:
        raise StorageError(f"TLS handshake with {url} failed: {exc}", url=url) from exc
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise StorageTimeoutError(f"{method} {url} timed out", url=url) from exc
    except aiohttp.ClientPayloadError as exc:
        raise TransientError(f"{method} {url}: body cut short ({exc})", url=url) from exc
    except (aiohttp.ClientConnectionError, ConnectionError) as exc:
        own = _own_cause(exc)
        if own is not None:  # our request-body generator failed, not the connection
            raise own from exc
        raise TransientError(f"{method} {url}: connection failed ({exc!r})", url=url) from exc
    except aiohttp.ClientResponseError as exc:
        raise status_error(exc.status, url, method=method) from exc
    except aiohttp.ClientError as exc:
        raise StorageError(f"{method} {url} failed: {exc!r}", url=url) from exc


@asynccontextmanager
async def map_socket_errors(url: str, method: str = "GET") -> AsyncIterator[None]:
    """Translate socket and TLS exceptions of our own connections, as aiohttp's are.

    The messages match :func:`map_client_errors`'s for the same causes.
    """
    try:
        yield
    except StorageError:
        raise
    except ssl.SSLCertVerificationError as exc:
        raise StorageError(
            f"TLS certificate of {url} was rejected ({exc}); pass "
            "storage_options={'verify': False} or ASYNCCACHE_VERIFY_TLS=0 to trust it",
            url=url,
        ) from exc
    except ssl.SSLError as exc:
        raise StorageError(f"TLS handshake with {url} failed: {exc}", url=url) from exc
    except TimeoutError as exc:
        raise StorageTimeoutError(f"{method} {url} timed out", url=url) from exc
    except OSError as exc:
        raise TransientError(f"{method} {url}: connection failed ({exc!r})", url=url) from exc


def _own_cause(exc: BaseException) -> StorageError | None:
    """The asynccache error aiohttp wrapped (e.g. from a streamed request body), if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, StorageError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None
