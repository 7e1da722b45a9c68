"""Listing the files of a source: which keys under a root match a glob, with sizes and ETags.

A glob is matched against keys relative to the root, ``/``-separated: ``*`` matches within
one path segment, ``?`` one character, ``[...]`` a set, and ``**`` any number of whole
segments (``**/*.jpg`` matches ``a.jpg`` and ``x/y/a.jpg``). Names starting with ``_`` or
``.`` in any segment are left out unless the glob names them (Parquet writers and this
library keep metadata there).
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
from collections.abc import Sequence

from ..errors import ConfigError, ObjectNotFoundError
from ..format.parquet import FileInfo
from ..storage.base import Storage

__all__ = ["NoFilesError", "glob_regex", "list_local", "list_remote", "matching"]


class NoFilesError(ConfigError):
    """No file of a source matches its glob (a :class:`ConfigError` to the user)."""


@functools.lru_cache(maxsize=64)
def glob_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of ``pattern`` (see the module docstring).

    Raises:
        ConfigError: an empty pattern, or one that starts with ``/``.
    """
    if not pattern or pattern.startswith("/"):
        raise ConfigError(f"files= must be a relative glob such as '**/*.jpg', got {pattern!r}")
    out = []
    segs = pattern.split("/")
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == "**":
            out.append(".*" if last else "(?:[^/]*/)*")
            continue
        j = 0
        while j < len(seg):
            c = seg[j]
            if c == "*":
                out.append("[^/]*")
            elif c == "?":
                out.append("[^/]")
            elif c == "[":
                k = seg.find("]", j + 1)
                if k < 0:
                    out.append(re.escape(c))
                else:
                    body = seg[j + 1 : k].replace("\\", "\\\\")
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    out.append(f"[{body}]")
                    j = k
            else:
                out.append(re.escape(c))
            j += 1
        if not last:
            out.append("/")
    return re.compile("".join(out))


def _hidden(key: str, pattern: str) -> bool:
    names = pattern.split("/")
    return any(
        part[:1] in ("_", ".") and not any(n[:1] in ("_", ".") for n in names)
        for part in key.split("/")
    )


def matching(infos: Sequence[FileInfo], pattern: str) -> list[FileInfo]:
    """The files of ``infos`` whose key matches ``pattern``, sorted by key."""
    rx = glob_regex(pattern)
    return sorted(
        (f for f in infos if rx.fullmatch(f.key) and not _hidden(f.key, pattern)),
        key=lambda f: f.key,
    )


def list_local(root: str, pattern: str) -> list[FileInfo]:
    """The files under directory ``root`` matching ``pattern``; the ETag of a local file is
    its modification time and size.

    Raises:
        ObjectNotFoundError: ``root`` is not a directory.
    """
    if not os.path.isdir(root):
        raise ObjectNotFoundError(f"{root}: no such directory", url=root)
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in files:
            full = os.path.join(dirpath, name)
            key = os.path.relpath(full, root).replace(os.sep, "/")
            try:
                st = os.stat(full)
            except FileNotFoundError:
                continue  # removed while listed
            found.append(FileInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}"))
    return matching(found, pattern)


async def list_remote(storage: Storage, pattern: str, timeout_s: float) -> list[FileInfo]:
    """The objects under ``storage``'s root matching ``pattern`` (one listing)."""
    prefix = _fixed_prefix(pattern)
    infos = await asyncio.wait_for(storage.list(prefix), timeout_s)
    return matching([FileInfo(o.key, o.size, o.etag or "") for o in infos], pattern)


def _fixed_prefix(pattern: str) -> str:
    """The directories ``pattern`` starts with that hold no wildcard (listed alone)."""
    parts = pattern.split("/")
    fixed = []
    for p in parts[:-1]:
        if any(ch in p for ch in "*?["):
            break
        fixed.append(p)
    return "/".join(fixed) + "/" if fixed else ""
