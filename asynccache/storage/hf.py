"""Hugging Face Hub backend, read-only: ``hf://datasets/org/name[@revision][/path]``.

Files are resolved the way ``huggingface_hub`` does (its ``hf_hub_url``): a ``HEAD`` on
``{endpoint}/datasets/{repo}/resolve/{revision}/{file}`` without following redirects
gives the size (``X-Linked-Size`` for LFS files, else ``Content-Length``), the ETag
(``X-Linked-Etag``/``ETag``) and the commit (``X-Repo-Commit``); a ``GET`` with
``Range`` follows the Hub's redirect to its CDN. Transport is our aiohttp session.

Invariants:
    * The token goes to the Hub's origin only: redirects are followed by hand and it is
      dropped as soon as one leaves that origin (:func:`.transport.send_following`), so a
      CDN or any other host never sees it. It never appears in a message or ``repr``.
    * The revision is pinned: the first answer's ``X-Repo-Commit`` becomes the revision of
      every later request, so one storage object reads one commit even while the branch
      moves (:attr:`HfStorage.commit`).
    * The CDN URL a redirect led to is reused for that file's other ranges until it
      expires or is refused, so parallel parts do not each cost a Hub round trip.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from huggingface_hub import hf_hub_url

from ..config import Settings
from ..errors import StorageError
from .base import ObjectInfo, Storage
from .errmap import map_client_errors, status_error
from .transport import (
    SessionHolder,
    check_range,
    encoded_url,
    origin_of,
    range_header,
    send_following,
    stream_response,
)

__all__ = ["HF_ENDPOINT", "HfStorage"]

HF_ENDPOINT = "https://huggingface.co"
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
#: How long a CDN location is reused (signed URLs live far longer).
_CDN_TTL_S = 300.0
_REDIRECTS = (301, 302, 303, 307, 308)


class HfStorage(Storage):
    """One dataset repository (or a folder of it) on the Hub, at one pinned commit.

    Args:
        url: the root URL as shown in messages.
        repo_id: ``org/name``. revision: branch, tag or commit (default ``main``).
        prefix: folder inside the repository, without slashes at either end.
        endpoint: the Hub (``https://huggingface.co``, ``HF_ENDPOINT``, a mirror).
        token: the Hub token, or None; ``token_source`` names where it came from.
        token_lookup: when True and ``token`` is None, ask ``huggingface_hub`` for a
            stored token (``hf auth login``) on first use.
        settings: connection limit, timeouts, TLS default. verify: verify TLS.
    """

    def __init__(
        self,
        url: str,
        *,
        repo_id: str,
        revision: str,
        prefix: str,
        endpoint: str,
        token: str | None,
        token_source: str | None,
        token_lookup: bool,
        settings: Settings,
        verify: bool,
    ) -> None:
        self.url = url
        self.repo_id = repo_id
        self.revision = revision
        self.prefix = prefix
        self.endpoint = endpoint.rstrip("/")
        self._token = token
        self._token_source = token_source
        self._token_lookup = token_lookup and token is None
        self._commit: str | None = revision if _SHA_RE.match(revision) else None
        self._pin_lock: asyncio.Lock | None = None
        self._cdn: dict[str, tuple[str, float]] = {}
        self._sessions = SessionHolder(settings, verify=verify)

    def __repr__(self) -> str:
        return (
            f"HfStorage({self.url!r}, endpoint={self.endpoint!r}, commit={self._commit!r}, "
            f"token={self._token_source or 'none'!r})"
        )

    @property
    def commit(self) -> str | None:
        """The commit every read comes from (None until the first answer pins it)."""
        return self._commit

    @property
    def pinned_url(self) -> str | None:
        """This root at its pinned commit (``hf://datasets/org/name@<sha>[/path]``), for
        other processes to open the very same files; None until pinned."""
        if self._commit is None:
            return None
        return f"hf://datasets/{self.repo_id}@{self._commit}" + (
            f"/{self.prefix}" if self.prefix else ""
        )

    @property
    def session_holder(self) -> SessionHolder:
        return self._sessions

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _resolve_href(self, key: str) -> str:
        return hf_hub_url(
            self.repo_id,
            self._name(key),
            repo_type="dataset",
            revision=self._commit or self.revision,
            endpoint=self.endpoint,
        )

    async def _auth(self) -> dict[str, str]:
        if self._token_lookup:
            self._token_lookup = False
            import huggingface_hub

            token = await asyncio.to_thread(huggingface_hub.get_token)
            if token:
                self._token, self._token_source = token, "huggingface_hub stored token"
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _error(self, status: int, url: str, headers: Any, method: str) -> StorageError:
        source = self._token_source or "no token: set HF_TOKEN for private or gated datasets"
        return status_error(status, url, headers=headers, method=method, credential_source=source)

    def _pin(self, headers: Any) -> None:
        commit = headers.get("X-Repo-Commit")
        if self._commit is None and commit and _SHA_RE.match(commit):
            self._commit = commit

    async def _ensure_pinned(self, key: str) -> None:
        if self._commit is not None:
            return
        if self._pin_lock is None:
            self._pin_lock = asyncio.Lock()
        async with self._pin_lock:
            if self._commit is None:
                await self._head_impl(key)

    # -- reads -----------------------------------------------------------------------
    async def _head_impl(self, key: str) -> ObjectInfo:
        url = self.object_url(key)
        href = self._resolve_href(key)
        home = origin_of(href)
        async with map_client_errors(url, "HEAD"):
            private = await self._auth()
            session = self._sessions.get()
            for _ in range(6):  # same-origin redirects only (a renamed repository)
                async with session.head(
                    encoded_url(href),
                    headers={"Accept-Encoding": "identity", **private},
                    allow_redirects=False,
                ) as resp:
                    headers = resp.headers
                    status = resp.status
                location = headers.get("Location")
                if status in _REDIRECTS and location and "X-Linked-Size" not in headers:
                    nxt = str(resp.url.join(encoded_url(location)))
                    if origin_of(nxt) == home:
                        href = nxt
                        continue
                break
            self._pin(headers)
            if status not in (200, *_REDIRECTS):
                raise self._error(status, url, headers, "HEAD")
            size = headers.get("X-Linked-Size")
            if status in _REDIRECTS and size is None:
                # Another host without the Hub's size headers: ask it, without the token.
                far = await send_following(
                    session,
                    "HEAD",
                    str(resp.url.join(encoded_url(headers.get("Location", "")))),
                    headers={"Accept-Encoding": "identity"},
                    private={},
                    what=url,
                )
                async with far:
                    if far.status != 200:
                        raise self._error(far.status, url, far.headers, "HEAD")
                    size = far.headers.get("Content-Length")
            size = size or headers.get("Content-Length")
        if size is None or not size.isdigit():
            raise StorageError(f"HEAD {url}: the Hub sent no size", url=url)
        etag = headers.get("X-Linked-Etag") or headers.get("ETag")
        return ObjectInfo(key=key, size=int(size), etag=etag)

    async def _iter_range_impl(self, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
        url = self.object_url(key)
        check_range(start, end, url)
        if end is not None and end == start:
            return
        await self._ensure_pinned(key)
        headers = {"Accept-Encoding": "identity"}
        rng = range_header(start, end)
        if rng:
            headers["Range"] = rng
        resp = None
        cached = self._cdn.get(key)
        async with map_client_errors(url):
            session = self._sessions.get()
            if cached is not None and cached[1] > time.monotonic():
                resp = await session.get(encoded_url(cached[0]), headers=headers)
                if resp.status in (401, 403, 404, 410):  # expired or revoked: ask the Hub
                    resp.release()
                    self._cdn.pop(key, None)
                    resp = None
            if resp is None:
                href = self._resolve_href(key)
                resp = await send_following(
                    session, "GET", href, headers=headers, private=await self._auth(), what=url
                )
                final = str(resp.url)
                if resp.status in (200, 206) and origin_of(final) != origin_of(href):
                    self._cdn[key] = (final, time.monotonic() + _CDN_TTL_S)
        if resp.status not in (200, 206, 416):
            try:
                raise self._error(resp.status, url, resp.headers, "GET")
            finally:
                resp.release()
        async for piece in stream_response(resp, url, start, end):
            yield piece

    async def _list_impl(self, prefix: str) -> list[ObjectInfo]:
        rev = quote(self._commit or self.revision, safe="")
        href: str | None = (
            f"{self.endpoint}/api/datasets/{self.repo_id}/tree/{rev}"
            + (f"/{quote(self.prefix)}" if self.prefix else "")
            + "?recursive=true&expand=false"
        )
        strip = len(self.prefix) + 1 if self.prefix else 0
        want = self._name(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        out: list[ObjectInfo] = []
        async with map_client_errors(self.url):
            session = self._sessions.get()
            while href:
                resp = await send_following(
                    session, "GET", href, headers={}, private=await self._auth(), what=self.url
                )
                async with resp:
                    body = await resp.read()
                    if resp.status == 404 and self.prefix:
                        return out  # no such folder: nothing under it
                    if resp.status != 200:
                        raise self._error(resp.status, self.url, resp.headers, "GET")
                    nxt = resp.links.get("next")
                    href = str(nxt["url"]) if nxt else None
                try:
                    entries = json.loads(body)
                except ValueError as exc:
                    raise StorageError(f"malformed listing from {self.url}", url=self.url) from exc
                for entry in entries:
                    path = str(entry.get("path", ""))
                    if entry.get("type") == "file" and path.startswith(want):
                        size = int(entry.get("size", 0))
                        out.append(ObjectInfo(key=path[strip:], size=size, etag=entry.get("oid")))
        return out

    async def _upload_impl(self, src: str, key: str) -> int:
        raise StorageError(
            f"{self.url} is read-only: hf:// datasets are published with huggingface_hub",
            url=self.object_url(key),
        )

    async def _delete_impl(self, key: str) -> None:
        raise StorageError(f"{self.url} is read-only: cannot delete", url=self.object_url(key))

    async def close(self) -> None:
        await self._sessions.close()
