"""The link to each storage endpoint as downloads see it, and the part size it calls for.

In the cloud a single connection is slow (tens of MB/s) and every request waits tens of
milliseconds for its first byte; on loopback both are nearly free. A fixed part size is
right for one regime only, so the downloader measures the link as it runs: every part that
completes reports its time to first byte and the rate its body arrived at on that one
connection (:meth:`LinkEstimate.observe`), and the next chunk's part size is chosen from
the running estimate (:func:`choose_part_bytes`).

The estimate is kept per storage endpoint, per process (:func:`link_for`): every dataset
read from one endpoint shares it, and a forked DataLoader worker starts from what its
parent measured.

Layer: pure arithmetic plus one small per-process table; imports config and forksafe.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
from urllib.parse import urlsplit

from ..bridge import forksafe
from ..config import Settings
from ..errors import ConfigError

__all__ = [
    "FIRST_BYTE_SHARE",
    "LinkEstimate",
    "PartBounds",
    "choose_part_bytes",
    "endpoint_of",
    "forget",
    "link_for",
    "part_bytes_for",
    "tile_part_bytes",
    "window_bytes",
]

#: A part's body takes at least this many first-byte waits to arrive, so the wait costs
#: each connection at most 1/(1 + FIRST_BYTE_SHARE) of its time.
FIRST_BYTE_SHARE = 10

_SAMPLES = 16  # the estimate is taken over this many latest samples
_MIN_RATE_BYTES = 256 << 10  # bodies shorter than this say little about the rate
_ALIGN = 1 << 20  # part sizes are whole MiB (tidier ranges; the hash needs no alignment)


@dataclasses.dataclass(frozen=True)
class PartBounds:
    """The sane range of part sizes: ``lo`` to ``hi`` bytes, in multiples of ``align``."""

    lo: int = 2 << 20
    hi: int = 64 << 20
    align: int = _ALIGN

    def __post_init__(self) -> None:
        if not 0 < self.lo <= self.hi or self.align <= 0:
            raise ConfigError(f"part bounds must have 0 < lo <= hi and align > 0: {self}")


def choose_part_bytes(
    start: int,
    *,
    bytes_ahead: int,
    concurrency: int,
    ttfb_s: float | None,
    bytes_per_s: float | None,
    bounds: PartBounds = PartBounds(),
) -> int:
    """The part size for the next chunk, with ``bytes_ahead`` bytes of chunks to fetch
    (this one, those downloading, and those due next).

    Starts from ``start`` (``ASYNCCACHE_PART_BYTES``'s default) and moves it by two rules:

    * **fill**: when the bytes ahead would make fewer parts than ``concurrency``
      connections, parts get smaller, down to ``fill = bytes_ahead / concurrency``, so
      every connection has one;
    * **first byte**: a part's body must take at least :data:`FIRST_BYTE_SHARE` first-byte
      waits (``ttfb_s * bytes_per_s`` bytes each, as measured on this link), so parts get
      larger when the link waits long for a first byte and then delivers fast. They grow
      no larger than ``max(start, fill / 2)``, so the bytes ahead still make twice as many
      parts as connections: with fewer requests than connections out, the link's
      throughput falls with every part taken away, and the bytes ahead overstate what is
      left to fetch (chunks downloading count whole, and a prefetch starts only when its
      parts fit beside those in flight).

    The result is clamped to ``bounds`` and aligned up to ``bounds.align`` (never above
    ``bounds.hi``). With no estimate yet (``ttfb_s`` or ``bytes_per_s`` None), only the
    fill rule applies.
    """
    fill = max(bytes_ahead, 1) / max(concurrency, 1)
    part = min(float(start), fill)
    if ttfb_s is not None and bytes_per_s is not None:
        wanted = FIRST_BYTE_SHARE * ttfb_s * bytes_per_s
        part = max(part, min(wanted, max(float(start), fill / 2)))
    part = min(max(part, bounds.lo), bounds.hi)
    # Aligned up, not down: parts of at least bytes_ahead / concurrency make at most
    # `concurrency` of them. Aligned down, two 63.9 MiB chunks on 16 connections went out
    # in 7 MiB parts, 10 each, and the second chunk waited for room beside the first.
    up = -(-int(part) // bounds.align) * bounds.align
    return max(bounds.lo, min(up, bounds.hi // bounds.align * bounds.align))


def tile_part_bytes(
    part: int, size: int, concurrency: int, bounds: PartBounds = PartBounds()
) -> int:
    """``part``, or smaller, so that the parts of chunks of ``size`` bytes fill
    ``concurrency`` connections with none left over.

    The downloader starts a chunk when all its parts fit beside those in flight (see
    :meth:`.Downloader._pump`), so with ``n`` parts a chunk, ``concurrency // n`` chunks run
    together and ``concurrency % n`` connections idle until a whole chunk lands: 64 MiB
    chunks in 10 MiB parts make 7 parts, and two chunks run on 14 of 16 connections. Here
    the count goes up to ``concurrency // k`` for the
    ``k = concurrency // n`` chunks that fit (8 parts: two chunks on all 16), or, past one
    chunk's worth, to the next multiple of ``concurrency``. An idle connection costs all of
    its time; a smaller part costs one more first-byte wait per part, at most doubled.

    Never larger than ``part``; aligned up and clamped to ``bounds`` as parts are (the
    alignment and the bounds may leave fewer parts than the tiled count, never fewer
    than ``part`` makes).
    """
    if size <= 0 or concurrency <= 1 or part <= 0:
        return part
    n = -(-size // part)
    if n <= 1:
        return part
    if n <= concurrency:
        n = concurrency // (concurrency // n)
    else:
        n = -(-n // concurrency) * concurrency
    tiled = -(-size // n)
    tiled = -(-tiled // bounds.align) * bounds.align
    tiled = max(bounds.lo, min(tiled, bounds.hi // bounds.align * bounds.align))
    return min(part, tiled)


class LinkEstimate:
    """A running estimate of one endpoint's link, from the parts that completed.

    Invariants:
        * :attr:`bytes_per_s` is the median of the latest ``_SAMPLES`` rates (one stalled
          request moves it little), and :attr:`ttfb_s` the least of the latest
          ``_SAMPLES`` first-byte waits: a busy client, whose loop or GIL holds the first
          piece back, only adds to a wait (a busy DataLoader worker can see many times
          the link's latency), and the link goes on delivering into the socket
          meanwhile. An underestimate only keeps parts nearer the start. None until the
          first observation that can say.
        * A rate is taken only from bodies of at least ``_MIN_RATE_BYTES``: a short body
          is mostly its first piece, and its "rate" would be that of the loop, not the
          link.
        * Safe from any thread (one mutex, held for a few list operations).
    """

    def __init__(self, endpoint: str = "") -> None:
        self.endpoint = endpoint
        self._mu = threading.Lock()
        self._ttfb: collections.deque[float] = collections.deque(maxlen=_SAMPLES)
        self._rate: collections.deque[float] = collections.deque(maxlen=_SAMPLES)
        self.observed = 0  # observations so far (for __repr__ and tests)

    def observe(self, ttfb_s: float, nbytes: int, transfer_s: float) -> None:
        """One request: ``ttfb_s`` from sending it to the first body byte, then
        ``nbytes`` more arrived over ``transfer_s`` seconds on the same connection."""
        with self._mu:
            self.observed += 1
            if ttfb_s >= 0:
                self._ttfb.append(ttfb_s)
            if nbytes >= _MIN_RATE_BYTES and transfer_s > 0:
                self._rate.append(nbytes / transfer_s)

    @property
    def ttfb_s(self) -> float | None:
        with self._mu:
            return min(self._ttfb) if self._ttfb else None

    @property
    def bytes_per_s(self) -> float | None:
        with self._mu:
            return statistics.median(self._rate) if self._rate else None

    def part_bytes(
        self,
        start: int,
        *,
        bytes_ahead: int,
        concurrency: int,
        bounds: PartBounds = PartBounds(),
    ) -> int:
        """:func:`choose_part_bytes` with this link's estimate."""
        return choose_part_bytes(
            start,
            bytes_ahead=bytes_ahead,
            concurrency=concurrency,
            ttfb_s=self.ttfb_s,
            bytes_per_s=self.bytes_per_s,
            bounds=bounds,
        )

    def _after_fork_in_child(self) -> None:
        self._mu = threading.Lock()  # the samples stay: the child uses the same link

    def __repr__(self) -> str:
        ttfb, rate = self.ttfb_s, self.bytes_per_s
        return (
            f"<LinkEstimate {self.endpoint} observed={self.observed} "
            f"ttfb_ms={'-' if ttfb is None else f'{ttfb * 1e3:.1f}'} "
            f"conn_MB/s={'-' if rate is None else f'{rate / 1e6:.1f}'}>"
        )


def part_bytes_for(
    settings: Settings, link: LinkEstimate, bytes_ahead: int, size: int | None = None
) -> int:
    """The part size of a chunk (of ``size`` bytes, when known) that a downloader starts
    now, with ``bytes_ahead`` bytes of chunks downloading or due next (this one included):
    ``settings.part_bytes`` when it is fixed, else chosen from ``link`` and then tiled to
    the connections (:func:`tile_part_bytes`).

    ``bytes_ahead`` is what there is to fill the connections with: at the start of an
    epoch (before the reader's hint) and at its end it is one or two chunks, and their
    parts are made small enough to give every connection one.
    """
    if not settings.adaptive_parts:
        return settings.part_bytes
    concurrency = settings.max_concurrency
    part = link.part_bytes(settings.part_bytes, bytes_ahead=bytes_ahead, concurrency=concurrency)
    return part if size is None else tile_part_bytes(part, size, concurrency)


def window_bytes(settings: Settings, link: LinkEstimate, budget: int) -> int:
    """The bytes the prefetch window holds at least: one part per connection, each of the
    size the link calls for with a full window (``PART_BYTES``, or larger where ten
    first-byte waits move more: see :func:`choose_part_bytes`), so never less than the
    link's bandwidth-delay product. At most a quarter of the cache ``budget`` (the node's
    epoch plan bounds prefetches further, see :mod:`asynccache.cache.plan`).

    With 64 MiB chunks ``PREFETCH_CHUNKS`` (4) holds more already; with 8 MiB chunks it
    held 32 MiB, half a second of a 16 x 4 MB/s link, and the window counts chunks up to
    this instead (:meth:`.Downloader.window_depth`). 0 (chunks only) when the part size
    is fixed (``ASYNCCACHE_PART_BYTES`` set without ``ADAPTIVE_PARTS``).
    """
    if not settings.adaptive_parts:
        return 0
    part = link.part_bytes(
        settings.part_bytes,
        bytes_ahead=settings.max_concurrency * PartBounds().hi * 2,
        concurrency=settings.max_concurrency,
    )
    return max(0, min(settings.max_concurrency * part, budget // 4))


class _Links:
    """This process's estimates, one per endpoint. The mutex is renewed in a forked child
    (it may have been held at the fork); the estimates are kept."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.by_endpoint: dict[str, LinkEstimate] = {}
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self.mu = threading.Lock()
        for link in self.by_endpoint.values():
            link._after_fork_in_child()


_LINKS = _Links()


def link_for(endpoint: str) -> LinkEstimate:
    """The estimate of ``endpoint``'s link in this process (created on first use)."""
    with _LINKS.mu:
        link = _LINKS.by_endpoint.get(endpoint)
        if link is None:
            link = _LINKS.by_endpoint[endpoint] = LinkEstimate(endpoint)
        return link


def forget(endpoint: str | None = None) -> None:
    """Drop what this process measured of ``endpoint`` (None: of every endpoint). For a
    benchmark that changes the link behind one endpoint between runs, or tests whose
    servers take loopback ports other servers had before them; a link does not change
    like that in use."""
    with _LINKS.mu:
        if endpoint is None:
            _LINKS.by_endpoint.clear()
        else:
            _LINKS.by_endpoint.pop(endpoint, None)


def endpoint_of(storage: object) -> str:
    """The endpoint a storage talks to: its ``endpoint`` (S3) or its URL's scheme and host."""
    endpoint = getattr(storage, "endpoint", None)
    if isinstance(endpoint, str) and endpoint:
        return endpoint
    url = str(getattr(storage, "url", ""))
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url
