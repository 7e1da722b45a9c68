"""A loopback imitation of the Hugging Face Hub's file endpoints, and of its CDN.

:class:`HubServer` runs two real ``aiohttp.web`` servers on free 127.0.0.1 ports: the
Hub and a CDN (another origin). Like the Hub, for dataset repositories it

* answers ``HEAD``/``GET /datasets/{org}/{name}/resolve/{revision}/{path}``: small
  ("git") files directly, with ``ETag``; large ("LFS") files with a 302 to a signed CDN
  URL, carrying ``X-Linked-Size`` and ``X-Linked-Etag``; every answer carries
  ``X-Repo-Commit`` (the commit the revision resolved to), errors carry ``X-Error-Code``
  (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``);
* lists ``GET /api/datasets/{org}/{name}/tree/{revision}[/{path}]?recursive=true``, in
  pages linked by ``Link: <...>; rel="next"``;
* checks ``Authorization: Bearer <token>`` for private repositories, on the Hub only.

The CDN serves ``GET``/``HEAD`` with ``Range`` for URLs the Hub signed and, like a real
pre-signed object store, refuses (400) any request that also carries ``Authorization``.
Every request is recorded with its headers (:attr:`HubServer.hub_requests`,
:attr:`HubServer.cdn_requests`) so tests can see where a token went.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import threading
from types import TracebackType
from urllib.parse import quote, unquote

from aiohttp import web

from .faults import ServerThread

__all__ = ["HubRequest", "HubServer"]

_LFS_MIN = 1024


@dataclasses.dataclass(frozen=True)
class HubRequest:
    """One request as a server saw it."""

    method: str
    path: str
    headers: dict[str, str]


@dataclasses.dataclass
class _Repo:
    private: bool
    commits: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)
    refs: dict[str, str] = dataclasses.field(default_factory=dict)


class HubServer:
    """The Hub and its CDN on loopback. Use as a context manager.

    Args:
        token: the token private repositories accept.
        page_size: entries per tree-listing page.
    """

    def __init__(self, *, token: str = "hf_test_token", page_size: int = 50) -> None:
        self.token = token
        self.page_size = page_size
        #: Send ``X-Linked-Size``/``X-Linked-Etag`` with redirects (the Hub does; a
        #: plain mirror may not).
        self.linked_headers = True
        self.hub_requests: list[HubRequest] = []
        self.cdn_requests: list[HubRequest] = []
        self._repos: dict[str, _Repo] = {}
        self._blobs: dict[str, bytes] = {}
        self._key = secrets.token_bytes(16)
        self._mu = threading.Lock()
        self._hub = ServerThread(self._hub_app, name="asynccache-hub")
        self._cdn = ServerThread(self._cdn_app, name="asynccache-hub-cdn")

    @property
    def url(self) -> str:
        """The Hub's endpoint (what ``HF_ENDPOINT`` would hold)."""
        return self._hub.url

    @property
    def cdn_url(self) -> str:
        return self._cdn.url

    def start(self) -> None:
        self._cdn.start()
        self._hub.start()

    def close(self) -> None:
        self._hub.close()
        self._cdn.close()

    def __enter__(self) -> HubServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def commit(
        self, repo_id: str, files: dict[str, bytes], *, branch: str = "main", private: bool = False
    ) -> str:
        """Make ``files`` the whole content of a new commit on ``branch``; return its sha."""
        with self._mu:
            repo = self._repos.setdefault(repo_id, _Repo(private=private))
            sha = hashlib.sha1(
                json.dumps(
                    sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())
                ).encode()
                + repo_id.encode()
                + str(len(repo.commits)).encode()
            ).hexdigest()
            repo.commits[sha] = dict(files)
            repo.refs[branch] = sha
            for data in files.values():
                self._blobs[hashlib.sha256(data).hexdigest()] = data
            return sha

    # -- the Hub -----------------------------------------------------------------------
    async def _hub_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route(
            "*", "/datasets/{org}/{name}/resolve/{revision}/{path:.+}", self._resolve
        )
        app.router.add_get("/api/datasets/{org}/{name}/tree/{revision}", self._tree)
        app.router.add_get("/api/datasets/{org}/{name}/tree/{revision}/{path:.*}", self._tree)
        return app

    def _record(self, log: list[HubRequest], request: web.Request) -> None:
        with self._mu:
            log.append(HubRequest(request.method, request.path_qs, dict(request.headers)))

    def _lookup(self, request: web.Request) -> tuple[str, dict[str, bytes]] | web.Response:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        revision = unquote(request.match_info["revision"])
        repo = self._repos.get(repo_id)
        authorized = request.headers.get("Authorization") == f"Bearer {self.token}"
        if repo is None or (repo.private and not authorized):
            # The Hub answers 401 for both, so a private repo's existence does not leak.
            return _error(401, "RepoNotFound", "Repository not found")
        sha = repo.refs.get(revision, revision)
        if sha not in repo.commits:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha, repo.commits[sha]

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        self._record(self.hub_requests, request)
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        sha, files = found
        path = unquote(request.match_info["path"])
        data = files.get(path)
        if data is None:
            resp = _error(404, "EntryNotFound", f"{path} does not exist")
            resp.headers["X-Repo-Commit"] = sha
            return resp
        digest = hashlib.sha256(data).hexdigest()
        headers = {"X-Repo-Commit": sha}
        if len(data) < _LFS_MIN:
            headers["ETag"] = f'"{hashlib.sha1(data).hexdigest()}"'
            if request.method == "HEAD":
                headers["Content-Length"] = str(len(data))
                return web.Response(headers=headers)
            return _ranged(request, data, headers)
        sig = hmac.new(self._key, digest.encode(), "sha256").hexdigest()
        headers["Location"] = f"{self.cdn_url}/blobs/{digest}?X-Signature={sig}&name={quote(path)}"
        if self.linked_headers:
            headers.update(
                {
                    "X-Linked-Size": str(len(data)),
                    "X-Linked-Etag": f'"{digest}"',
                    "ETag": f'"{digest}"',
                }
            )
        return web.Response(status=302, headers=headers)

    async def _tree(self, request: web.Request) -> web.Response:
        self._record(self.hub_requests, request)
        found = self._lookup(request)
        if isinstance(found, web.Response):
            return found
        _, files = found
        base = unquote(request.match_info.get("path", "")).strip("/")
        under = sorted(p for p in files if not base or p.startswith(base + "/"))
        start = int(request.query.get("cursor", "0"))
        page = under[start : start + self.page_size]
        body = [
            {
                "type": "file",
                "path": p,
                "size": len(files[p]),
                "oid": hashlib.sha1(files[p]).hexdigest(),
            }
            for p in page
        ]
        headers = {}
        if start + self.page_size < len(under):
            nxt = request.url.update_query(cursor=str(start + self.page_size))
            headers["Link"] = f'<{nxt}>; rel="next"'
        return web.json_response(body, headers=headers)

    # -- the CDN -----------------------------------------------------------------------
    async def _cdn_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/blobs/{digest}", self._blob)
        return app

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        self._record(self.cdn_requests, request)
        digest = request.match_info["digest"]
        sig = hmac.new(self._key, digest.encode(), "sha256").hexdigest()
        if not hmac.compare_digest(request.query.get("X-Signature", ""), sig):
            return web.Response(status=403, text="bad signature")
        if "Authorization" in request.headers:
            return web.Response(
                status=400, text="Only one auth mechanism allowed; a signed URL was given"
            )
        data = self._blobs.get(digest)
        if data is None:
            return web.Response(status=404)
        headers = {"ETag": f'"{digest}"'}
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return web.Response(headers=headers)
        return _ranged(request, data, headers)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers={"X-Error-Code": code})


def _ranged(request: web.Request, data: bytes, headers: dict[str, str]) -> web.Response:
    rng = request.headers.get("Range")
    if not rng:
        return web.Response(body=data, headers=headers)
    first, _, last = rng.removeprefix("bytes=").partition("-")
    start = int(first)
    end = min(int(last) + 1, len(data)) if last else len(data)
    if start >= len(data):
        return web.Response(
            status=416, headers={**headers, "Content-Range": f"bytes */{len(data)}"}
        )
    return web.Response(
        status=206,
        body=data[start:end],
        headers={**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"},
    )
