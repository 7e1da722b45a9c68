"""Local (or network-mounted) directory backend: ``/data/ds`` or ``file:///data/ds``.

Invariants: objects are read in place (``local_path``); an upload becomes visible only
complete, via a temporary file in the destination directory and ``os.replace``; file
I/O runs in worker threads so the event loop never blocks on the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiofiles

from ..errors import AuthError, ObjectNotFoundError, StorageError
from .base import ObjectInfo, Storage, _check_key
from .transport import check_range

__all__ = ["LocalStorage"]

_PIECE = 1 << 20
#: Prefix of upload temp files; ``list`` hides them.
TEMP_PREFIX = ".asynccache-tmp-"


class LocalStorage(Storage):
    """A directory holding the dataset's files.

    Args:
        root: the directory (need not exist yet: uploads create it).
        url: the URL as the user gave it, for messages.
    """

    is_local = True

    def __init__(self, root: str | os.PathLike[str], url: str | None = None) -> None:
        self.root = Path(root)
        self.url = url if url is not None else str(self.root)

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def local_path(self, key: str) -> str | None:
        return str(self.root / _check_key(key, self.url))

    async def _head_impl(self, key: str) -> ObjectInfo:
        path = self.root / key
        with _mapped(self.object_url(key)):
            st = await asyncio.to_thread(os.stat, path)
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(
                f"not a file: {self.object_url(key)}", url=self.object_url(key)
            )
        return ObjectInfo(key=key, size=st.st_size, etag=f"{st.st_mtime_ns:x}-{st.st_size:x}")

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        url = self.object_url(key)
        check_range(start, end, url)
        with _mapped(url):
            f = await aiofiles.open(self.root / key, "rb")
        try:
            with _mapped(url):
                await f.seek(start)
            remaining = None if end is None else end - start
            while remaining is None or remaining > 0:
                n = _PIECE if remaining is None else min(_PIECE, remaining)
                with _mapped(url):
                    piece = await f.read(n)
                if not piece:
                    break
                if remaining is not None:
                    remaining -= len(piece)
                yield piece
        finally:
            await f.close()

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        with _mapped(self.url):
            return await asyncio.to_thread(self._list_sync, prefix)

    def _list_sync(self, prefix: str) -> list[ObjectInfo]:
        if not self.root.exists():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(TEMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(ObjectInfo(key=key, size=full.stat().st_size))
        return out

    async def _upload_impl(self, src: str, key: str) -> int:
        with _mapped(self.object_url(key)):
            return await asyncio.to_thread(self._upload_sync, src, key)

    def _upload_sync(self, src: str, key: str) -> int:
        dest = self.root / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=dest.parent)
        try:
            with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
                shutil.copyfileobj(fin, fout, _PIECE)
                size = fout.tell()
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return size

    async def _delete_impl(self, key: str) -> None:
        with contextlib.suppress(ObjectNotFoundError), _mapped(self.object_url(key)):
            await asyncio.to_thread(os.unlink, self.root / key)


@contextlib.contextmanager
def _mapped(url: str) -> Iterator[None]:
    """OSError -> the storage tree, naming ``url``."""
    try:
        yield
    except StorageError:
        raise
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        raise ObjectNotFoundError(f"not found: {url}", url=url) from exc
    except PermissionError as exc:
        raise AuthError(f"permission denied: {url}", url=url) from exc
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "?")
        raise StorageError(f"I/O error on {url}: {code} {exc.strerror}", url=url) from exc
