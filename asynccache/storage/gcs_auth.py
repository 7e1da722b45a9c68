"""Credentials for the GCS backend, delegated to google-auth.

Order: ``storage_options`` (``token``: an OAuth2 access token; ``key_file``: a
service-account or authorized-user JSON file; ``anon``: no credentials), then, against an
emulator endpoint, anonymous unless ``anon=False``, else google-auth's standard chain
(``google.auth.default``: ``GOOGLE_APPLICATION_CREDENTIALS``, the gcloud
application-default file, the metadata server), which google-auth reads itself.

Invariants: the chain is resolved and tokens are refreshed off the event loop (both may
do blocking I/O), one refresh at a time; a token never appears in a message or ``repr``,
only its *source* is named.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from ..errors import AuthError, ConfigError

__all__ = ["GcsAuth"]

#: Read and write on objects: what upload, delete and reads need.
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)


class GcsAuth:
    """Authorization headers for GCS requests.

    Args:
        options: ``storage_options`` (``token``, ``key_file``, ``anon``).
        emulator: True when the endpoint is an emulator (anonymous unless told otherwise).
    """

    def __init__(self, options: Mapping[str, Any], *, emulator: bool) -> None:
        self._token: str | None = None
        self._credentials: Any = None
        self._key_file: str | None = None
        self._lock: asyncio.Lock | None = None
        token, key_file = options.get("token"), options.get("key_file")
        # An explicit anon=False asks for the default chain even against an endpoint.
        anon = bool(options["anon"]) if "anon" in options else emulator
        if sum(x is not None for x in (token, key_file, options.get("anon") or None)) > 1:
            raise ConfigError("storage_options: give at most one of token, key_file and anon")
        if token is not None:
            if not isinstance(token, str) or not token:
                raise ConfigError("storage option 'token' must be a non-empty str")
            self._token = token
            self.source = "storage_options token"
        elif key_file is not None:
            self._key_file = os.fspath(key_file)
            self.source = f"key file {self._key_file}"
        elif anon:
            self.source = "anonymous"
        else:
            self.source = "google-auth default chain"
        self.anonymous = self.source == "anonymous"

    def __repr__(self) -> str:
        return f"GcsAuth(source={self.source!r})"

    async def headers(self) -> dict[str, str]:
        """``Authorization`` for the next request ({} when anonymous)."""
        if self.anonymous:
            return {}
        if self._token is not None:
            return {"Authorization": f"Bearer {self._token}"}
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._credentials is None:
                self._credentials = await asyncio.to_thread(self._load)
            creds = self._credentials
            if not creds.valid:
                await asyncio.to_thread(self._refresh, creds)
        return {"Authorization": f"Bearer {creds.token}"}

    def _load(self) -> Any:
        import google.auth
        import google.auth.exceptions

        try:
            if self._key_file is not None:
                creds = _from_key_file(self._key_file)
            else:
                creds, _ = google.auth.default(scopes=SCOPES)
        except OSError as exc:
            raise AuthError(f"GCS credentials: cannot read {self.source}: {exc.strerror}") from exc
        except ValueError as exc:  # malformed JSON or key; the text names no secret
            raise AuthError(f"GCS credentials: {self.source} is not a usable key file") from exc
        except google.auth.exceptions.DefaultCredentialsError as exc:
            # The message names files and variables, never a secret.
            raise AuthError(
                f"no usable GCS credentials from {self.source}: {exc}; pass "
                "storage_options={'anon': True} for public buckets"
            ) from exc
        self.source = f"{self.source} ({type(creds).__module__}.{type(creds).__name__})"
        return creds

    def _refresh(self, creds: Any) -> None:
        import google.auth.exceptions
        import google.auth.transport.requests

        try:
            creds.refresh(google.auth.transport.requests.Request())
        except google.auth.exceptions.GoogleAuthError as exc:
            raise AuthError(
                f"could not refresh GCS credentials from {self.source}: {type(exc).__name__}"
            ) from exc


def _from_key_file(path: str) -> Any:
    """Service-account or authorized-user credentials from a JSON key file, by its type."""
    import json

    from google.oauth2 import credentials, service_account

    with open(path, encoding="utf-8") as f:
        info = json.load(f)
    kind = info.get("type") if isinstance(info, dict) else None
    if kind == "service_account":
        return service_account.Credentials.from_service_account_info(info, scopes=SCOPES)
    if kind == "authorized_user":
        return credentials.Credentials.from_authorized_user_info(info, scopes=SCOPES)
    raise ValueError(f"unsupported key file type {kind!r}")
