"""Credentials and SigV4 signing for the S3 backend, delegated to botocore.

Credentials come from ``storage_options`` (``aws_access_key_id``,
``aws_secret_access_key``, ``aws_session_token``) when given, else from botocore's
standard chain (env, ``AWS_PROFILE``, shared files, container/instance metadata).
Invariant: the secret never appears in a message or ``repr``; only the *source*
(``storage_options`` or botocore's ``credentials.method``) is ever named.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Mapping
from typing import Any

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials, ReadOnlyCredentials

from ..errors import AuthError

__all__ = ["S3Signer"]

# S3SigV4Auth reads this to decide on payload signing; bodies are streamed unsigned.
_UNSIGNED_PAYLOAD_CONFIG = types.SimpleNamespace(s3={"payload_signing_enabled": False})


class S3Signer:
    """Signs requests for one region with credentials resolved once, lazily.

    Args:
        options: ``storage_options`` (may hold explicit keys, ``profile`` or ``anon``).
        aws_env: the ``AWS_*`` variables (``AWS_PROFILE`` is honoured).
        region: the signing region.
    """

    def __init__(self, options: Mapping[str, Any], aws_env: Mapping[str, str], region: str) -> None:
        self.region = region
        self.anonymous = bool(options.get("anon", False))
        self._profile = options.get("profile") or aws_env.get("AWS_PROFILE")
        self._credentials: Credentials | None = None
        self._resolved = False
        self.source = "anonymous" if self.anonymous else "botocore credential chain"
        key = options.get("aws_access_key_id")
        secret = options.get("aws_secret_access_key")
        if (key is None) != (secret is None):
            raise AuthError(
                "storage_options must give both aws_access_key_id and "
                "aws_secret_access_key, or neither"
            )
        if key is not None and secret is not None:
            self._credentials = Credentials(
                str(key), str(secret), options.get("aws_session_token"), method="storage_options"
            )
            self._resolved = True
            self.source = "storage_options"

    def __repr__(self) -> str:
        return f"S3Signer(region={self.region!r}, source={self.source!r})"

    async def _resolve(self) -> Credentials | None:
        if not self._resolved:
            # The chain may read files or query instance metadata: not on the loop.
            self._credentials = await asyncio.to_thread(self._from_chain)
            self._resolved = True
            if self._credentials is not None:
                self.source = f"botocore {self._credentials.method}"
        return self._credentials

    def _from_chain(self) -> Credentials | None:
        import botocore.session

        session = botocore.session.Session(profile=self._profile)
        try:
            return session.get_credentials()
        except Exception as exc:  # botocore raises many kinds for a broken profile
            raise AuthError(
                f"could not load AWS credentials (profile {self._profile!r}): {type(exc).__name__}"
            ) from exc

    async def frozen(self) -> ReadOnlyCredentials | None:
        """Current credentials (refreshed off-loop when expiring); None when anonymous."""
        if self.anonymous:
            return None
        creds = await self._resolve()
        if creds is None:
            raise AuthError(
                "no AWS credentials found (storage_options, environment, "
                "profile or instance metadata); pass storage_options="
                "{'anon': True} for public buckets"
            )
        refresh_needed = getattr(creds, "refresh_needed", None)
        if callable(refresh_needed) and refresh_needed():
            return await asyncio.to_thread(creds.get_frozen_credentials)
        return creds.get_frozen_credentials()

    async def sign(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> dict[str, str]:
        """Headers (including ``Authorization``) for ``method url``, payload unsigned.

        ``url`` must already be percent-encoded exactly as it will be sent.
        """
        hdrs = dict(headers or {})
        frozen = await self.frozen()
        if frozen is None:
            return hdrs
        request = AWSRequest(method=method, url=url, headers=hdrs, data=body or b"")
        request.context["client_config"] = _UNSIGNED_PAYLOAD_CONFIG
        creds = Credentials(frozen.access_key, frozen.secret_key, frozen.token)
        S3SigV4Auth(creds, "s3", self.region).add_auth(request)
        return dict(request.headers.items())
