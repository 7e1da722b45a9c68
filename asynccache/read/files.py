"""A folder of files read without conversion: each file is one item.

``FilesSource(url, files="**/*.jpg")`` lists the files under ``url`` that match the glob
(sorted by key) and caches that listing as its index, in this node's cache directory:
later opens read no listing until ``refresh=True`` asks for one. Consecutive files are
packed into units of about ``pack_bytes`` (a larger file is a unit of its own); a unit is
fetched into the cache as one entry, its files many at a time, and counts against the
cache budget like a chunk. A worker hands each file to ``decode(key, data)`` (with
``labels=``, ``decode(key, data, label)``); without ``decode`` an item is
``{"key": key, "data": bytes}`` (and ``"label"``).

Labels: ``"dir"``, the name of the file's folder, numbered in the sorted order of the
folder names (``train/cat/1.jpg`` -> the number of ``cat``); or the key of a side file under
``url``: JSON ``{key: label}`` or CSV lines ``key,label``; a listed file without a label is
a :class:`ConfigError` naming it.

Trust (docs/sources.md, "Folders of files"): a file is read with the size the listing
gave; a file gone, or answering with another size, fails naming it. A file rewritten with
the same size after the listing is read as it is now: refresh the listing to see changes.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np
import xxhash

from ..bridge import get_loop_thread
from ..cache.fsutil import atomic_write
from ..config import Settings
from ..errors import ConfigError, CorruptIndexError, ObjectNotFoundError
from ..format import ChunkEntry, Index
from ..format.parquet import FileInfo
from .listing import NoFilesError, glob_regex, list_local, list_remote
from .source import local_dir
from .source_units import Decode, UnitSource
from .unit_storage import Piece, Unit

__all__ = ["PACK_BYTES", "FilesSource", "FilesUnit"]

log = logging.getLogger(__name__)

#: Bytes of files packed into one unit (one cache entry) at most, unless ``part_bytes``
#: (``ASYNCCACHE_PART_BYTES``) is smaller: a unit then fills about one ranged part.
PACK_BYTES = 4 << 20
#: Files packed into one unit at most.
PACK_FILES = 64
_LISTING_FORMAT = "asynccache-listing"


class FilesSource(UnitSource):
    """The files under ``url`` matching ``files``, one item each. See the module docstring.

    Raises (when made):
        ConfigError: no file matches the glob (names the URL and the glob); a bad
            ``labels=``, or a file without a label (names it).
        ObjectNotFoundError: ``url`` (a local directory) or the labels file is missing.
    """

    verify_after = False  # a HEAD per small file would double the requests

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        files: str,
        decode: Callable[..., Any] | None = None,
        labels: Any = None,
        refresh: bool = False,
        pack_bytes: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        settings: Settings | None = None,
    ) -> None:
        glob_regex(files)  # a bad glob fails here
        if decode is not None and not callable(decode):
            raise ConfigError(f"decode= must be a function (key, data) -> item, got {decode!r}")
        if labels is not None and not isinstance(labels, str):
            raise ConfigError(f"labels= must be 'dir' or a side file's key, got {labels!r}")
        if pack_bytes is not None and pack_bytes <= 0:
            raise ConfigError(f"pack_bytes must be > 0, got {pack_bytes}")
        self.pattern, self.decode_fn, self.labels_from = files, decode, labels
        self.refresh, self._pack = refresh, pack_bytes
        super().__init__(
            url, cache_dir=cache_dir, storage_options=storage_options, settings=settings
        )

    # -- the index -----------------------------------------------------------------
    @property
    def pack_bytes(self) -> int:
        return self._pack or min(PACK_BYTES, self.settings.part_bytes)

    def _build(self) -> tuple[Index, Mapping[str, Unit]]:
        listing = self._listing()
        if not listing:
            raise NoFilesError(f"{self.url}: no file matches files={self.pattern!r}")
        labels = self._labels(listing) if self.labels_from is not None else None
        tag = xxhash.xxh3_64(
            "\0".join(f"{f.key}\0{f.size}\0{f.etag}" for f in listing).encode()
        ).hexdigest()[:12]
        base = self.url.rstrip("/")
        chunks: list[ChunkEntry] = []
        units: dict[str, Unit] = {}
        groups: list[tuple[int, int]] = []
        start = 0
        while start < len(listing):
            end, nbytes = start, 0
            while end < len(listing) and end - start < PACK_FILES:
                size = listing[end].size
                if end > start and nbytes + size > self.pack_bytes:
                    break
                nbytes += size
                end += 1
            name = f"chunk-files-{tag}-{len(chunks)}.bin"
            pieces = tuple(Piece(f.key, 0, f.size, f.size, f.etag) for f in listing[start:end])
            where = f"{base}/{listing[start].key}" + (
                f" (and {end - start - 1} files after it)" if end - start > 1 else ""
            )
            units[name] = Unit(pieces, where)
            chunks.append(ChunkEntry(name, end - start, nbytes, "", ((start, end - start),)))
            groups.append((start, end))
            start = end
        self.keys = [f.key for f in listing]
        self.sizes = [f.size for f in listing]
        self.label_values = labels
        self.groups = groups
        index = Index(tuple(chunks), {"source": "files", "files": self.pattern})
        return index, units

    def _listing_path(self) -> str:
        digest = hashlib.sha256(f"{self.url}\n{self.pattern}".encode()).hexdigest()[:32]
        return os.path.join(self.settings.cache_dir, ".sources", f"{digest}.listing")

    def _listing(self) -> list[FileInfo]:
        path = self._listing_path()
        if not self.refresh:
            got = _load_listing(path, self.url, self.pattern)
            if got is not None:
                return got
        if self.remote:
            listing = get_loop_thread().call(
                list_remote(self.inner_storage(), self.pattern, self.settings.timeout_s * 20),
                self.settings.timeout_s * 21,
            )
        else:
            listing = list_local(local_dir(self.url), self.pattern)
        if listing:
            _save_listing(path, self.url, self.pattern, listing)
        return listing

    def _labels(self, listing: list[FileInfo]) -> list[Any]:
        if self.labels_from == "dir":
            parents = [os.path.dirname(f.key).rsplit("/", 1)[-1] for f in listing]
            names = sorted(set(parents))
            number = {n: i for i, n in enumerate(names)}
            self.classes = names
            return [number[p] for p in parents]
        side = str(self.labels_from)
        where = f"{self.url.rstrip('/')}/{side}"
        data = self._side_file(side, where)
        table = _parse_labels(data, side, where)
        out = []
        for f in listing:
            if f.key not in table:
                raise ConfigError(f"{where}: no label for {f.key}")
            out.append(table[f.key])
        return out

    def _side_file(self, key: str, where: str) -> bytes:
        if not self.remote:
            try:
                with open(os.path.join(local_dir(self.url), key), "rb") as f:
                    return f.read()
            except FileNotFoundError as exc:
                raise ObjectNotFoundError(f"{where}: labels file missing", url=where) from exc
        storage = self.inner_storage()
        return bytes(get_loop_thread().call(storage.read(key), self.settings.timeout_s * 4))

    # -- decoding ------------------------------------------------------------------
    def decoder(self) -> Decode:
        return _Decoder(self.keys, self.sizes, self.groups, self.label_values, self.decode_fn)


def _parse_labels(data: bytes, key: str, where: str) -> dict[str, Any]:
    try:
        if key.endswith(".json"):
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            return {str(k): v for k, v in doc.items()}
        table: dict[str, Any] = {}
        for row in csv.reader(io.StringIO(data.decode())):
            if not row or row[0].startswith("#"):
                continue
            if len(row) < 2:
                raise ValueError(f"line {row!r} is not key,label")
            label = row[1].strip()
            table[row[0].strip()] = int(label) if label.lstrip("-").isdigit() else label
        return table
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not a labels file ({exc})") from exc


class _Decoder:
    def __init__(
        self,
        keys: list[str],
        sizes: list[int],
        groups: list[tuple[int, int]],
        labels: list[Any] | None,
        fn: Callable[..., Any] | None,
    ) -> None:
        self.keys, self.sizes, self.groups, self.labels, self.fn = keys, sizes, groups, labels, fn

    def __call__(self, ci: int, data: bytes) -> FilesUnit:
        a, b = self.groups[ci]
        labels = None if self.labels is None else self.labels[a:b]
        return FilesUnit(data, self.keys[a:b], self.sizes[a:b], labels, self.fn)


class FilesUnit:
    """The files of one unit, back to back in ``data``; an item per file."""

    def __init__(
        self,
        data: bytes,
        keys: list[str],
        sizes: list[int],
        labels: list[Any] | None,
        fn: Callable[..., Any] | None,
    ) -> None:
        self.data, self.keys, self.labels, self.fn = data, keys, labels, fn
        self.offsets: list[int] = [0, *np.cumsum(sizes).tolist()]

    def __len__(self) -> int:
        return len(self.keys)

    def item(self, pos: int) -> Any:
        body = self.data[self.offsets[pos] : self.offsets[pos + 1]]
        key = self.keys[pos]
        if self.fn is not None:
            if self.labels is not None:
                return self.fn(key, body, self.labels[pos])
            return self.fn(key, body)
        out: dict[str, Any] = {"key": key, "data": body}
        if self.labels is not None:
            out["label"] = self.labels[pos]
        return out

    def columns(self, positions: np.ndarray) -> dict[str, Any] | None:
        return None


def _load_listing(path: str, url: str, pattern: str) -> list[FileInfo] | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 8 or xxhash.xxh3_64(data[8:]).digest() != data[:8]:
            raise CorruptIndexError(f"{path}: damaged listing")
        doc = msgpack.unpackb(data[8:], raw=False)
        if doc.get("format") != _LISTING_FORMAT or (doc["url"], doc["files"]) != (url, pattern):
            return None
        return [FileInfo(str(k), int(s), str(e)) for k, s, e in doc["listing"]]
    except (OSError, CorruptIndexError, ValueError, KeyError, TypeError) as exc:
        log.debug("no usable listing at %s: %r", path, exc)
        return None


def _save_listing(path: str, url: str, pattern: str, listing: list[FileInfo]) -> None:
    body = msgpack.packb(
        {
            "format": _LISTING_FORMAT,
            "url": url,
            "files": pattern,
            "listing": [[f.key, f.size, f.etag] for f in listing],
        },
        use_bin_type=True,
    )
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, [xxhash.xxh3_64(body).digest(), body])
    except Exception as exc:  # listed again next time
        log.debug("listing not cached at %s: %r", path, exc)
