"""Credentials for the Azure Blob backend, delegated to the Azure SDK.

Sources, first match wins: ``storage_options`` (``connection_string``; ``account_key``
for SharedKey; ``sas_token``; ``credential``: ``"default"`` or an azure-identity
credential object; ``anon``), then the ``AZURE_STORAGE_*`` variables handed over by
``Settings.aws_env()`` (connection string, key, SAS token), then azure-identity's
``DefaultAzureCredential`` (environment, workload identity, managed identity, Azure
CLI...), which reads its own variables.

SharedKey requests are signed by the SDK's own policy (``SharedKeyCredentialPolicy``)
on a copy of the request; the request itself goes out on our aiohttp session. Tokens
come from the credential's ``get_token`` and are refreshed before they expire.

Invariant: no key, signature, SAS or token appears in a message or ``repr``; only the
*source* is named.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Mapping
from typing import Any

from ..errors import AuthError, ConfigError

__all__ = ["AzureAuth"]

#: OAuth scope for Azure Storage.
SCOPE = "https://storage.azure.com/.default"
_TOKEN_SLACK_S = 300


class AzureAuth:
    """Authorization for one storage account.

    Args:
        account: the account name.
        account_key: SharedKey secret (base64), or None.
        sas_token: a SAS query string (without ``?``), or None.
        credential: an azure-identity credential (sync or async), ``"default"`` for
            ``DefaultAzureCredential``, or None.
        source: where these came from, for messages.
    """

    def __init__(
        self,
        account: str,
        *,
        account_key: str | None = None,
        sas_token: str | None = None,
        credential: Any = None,
        source: str,
    ) -> None:
        self.account = account
        self.source = source
        self.sas_token = sas_token.lstrip("?") if sas_token else None
        self._policy: Any = None
        if account_key is not None:
            from azure.storage.blob._shared.authentication import SharedKeyCredentialPolicy

            self._policy = SharedKeyCredentialPolicy(account, account_key)
        self._credential = credential
        self._owns_credential = credential == "default"
        self._token: Any = None
        self._lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        return f"AzureAuth(account={self.account!r}, source={self.source!r})"

    @property
    def anonymous(self) -> bool:
        return self._policy is None and self.sas_token is None and self._credential is None

    def query(self, query: Mapping[str, str]) -> dict[str, str]:
        """``query`` plus the SAS parameters, when authenticating by SAS."""
        out = dict(query)
        if self.sas_token:
            from urllib.parse import parse_qsl

            out.update(parse_qsl(self.sas_token, keep_blank_values=True))
        return out

    async def sign(self, method: str, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        """Headers for ``method url`` with ``Authorization`` added (SharedKey or bearer).

        ``url`` must be encoded exactly as it will be sent.
        """
        hdrs = dict(headers)
        if self._policy is not None:
            from azure.core.pipeline import PipelineContext, PipelineRequest
            from azure.core.pipeline.transport import HttpRequest

            request = HttpRequest(method, url, headers=hdrs)
            try:
                self._policy.on_request(PipelineRequest(request, PipelineContext(None)))
            except Exception as exc:  # AzureSigningError: a key that is not base64
                raise AuthError(
                    f"cannot sign Azure requests with the account key from {self.source} "
                    f"({type(exc).__name__})"
                ) from exc
            return dict(request.headers)
        if self._credential is not None:
            hdrs["Authorization"] = f"Bearer {await self._bearer()}"
        return hdrs

    async def _bearer(self) -> str:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            token = self._token
            if token is None or token.expires_on - _TOKEN_SLACK_S < time.time():
                self._token = token = await self._get_token()
            return str(token.token)

    async def _get_token(self) -> Any:
        if self._credential == "default":
            from azure.identity.aio import DefaultAzureCredential

            self._credential = DefaultAzureCredential()
        try:
            got = self._credential.get_token(SCOPE)
            if inspect.isawaitable(got):
                return await got
            return got
        except Exception as exc:  # ClientAuthenticationError, CredentialUnavailableError
            raise AuthError(
                f"no Azure token from {self.source}: {type(exc).__name__}; give "
                "storage_options account_key, sas_token or connection_string, or "
                "{'anon': True} for public containers"
            ) from exc

    async def close(self) -> None:
        """Close a credential this object created (``"default"``)."""
        cred, owned = self._credential, self._owns_credential
        if owned and cred is not None and cred != "default":
            closing = getattr(cred, "close", None)
            if closing is not None:
                result = closing()
                if inspect.isawaitable(result):
                    await result


def resolve(
    options: Mapping[str, Any], env: Mapping[str, str], account_hint: str | None, url: str
) -> tuple[AzureAuth, str | None]:
    """``(auth, endpoint from a connection string or None)`` for ``url``."""
    conn = options.get("connection_string")
    where = "storage_options"
    if conn is None and not any(
        k in options for k in ("account_key", "sas_token", "credential", "anon")
    ):
        conn = env.get("AZURE_STORAGE_CONNECTION_STRING")
        where = "AZURE_STORAGE_CONNECTION_STRING"
    if conn is not None:
        return _from_connection_string(str(conn), where, url)
    account = options.get("account_name") or account_hint or env.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise ConfigError(
            f"{url}: no Azure storage account; use az://container@account/..., "
            "storage_options={'account_name': ...}, AZURE_STORAGE_ACCOUNT or a connection string"
        )
    account = str(account)
    given = [k for k in ("account_key", "sas_token", "credential") if options.get(k) is not None]
    if options.get("anon"):
        given.append("anon")
    if len(given) > 1:
        raise ConfigError(f"{url}: give at most one of {given} in storage_options")
    if options.get("account_key") is not None:
        key = str(options["account_key"])
        return AzureAuth(account, account_key=key, source="storage_options account_key"), None
    if options.get("sas_token") is not None:
        sas = str(options["sas_token"])
        return AzureAuth(account, sas_token=sas, source="storage_options sas_token"), None
    if options.get("credential") is not None:
        cred = options["credential"]
        return AzureAuth(account, credential=cred, source=_credential_name(cred)), None
    if options.get("anon"):
        return AzureAuth(account, source="anonymous"), None
    if env.get("AZURE_STORAGE_KEY"):
        key = env["AZURE_STORAGE_KEY"]
        return AzureAuth(account, account_key=key, source="AZURE_STORAGE_KEY"), None
    if env.get("AZURE_STORAGE_SAS_TOKEN"):
        sas = env["AZURE_STORAGE_SAS_TOKEN"]
        return AzureAuth(account, sas_token=sas, source="AZURE_STORAGE_SAS_TOKEN"), None
    return AzureAuth(account, credential="default", source="DefaultAzureCredential"), None


def _credential_name(cred: Any) -> str:
    if cred == "default":
        return "DefaultAzureCredential"
    if not callable(getattr(cred, "get_token", None)):
        raise ConfigError(
            "storage option 'credential' must be 'default' or an azure-identity credential"
        )
    return f"storage_options credential ({type(cred).__name__})"


def _from_connection_string(conn: str, where: str, url: str) -> tuple[AzureAuth, str]:
    from azure.storage.blob import BlobServiceClient

    try:
        client = BlobServiceClient.from_connection_string(conn)
    except (ValueError, KeyError) as exc:  # the SDK's message quotes no secret
        raise ConfigError(f"{url}: the connection string from {where} is malformed") from exc
    endpoint, _, sas = client.url.partition("?")
    key = getattr(client.credential, "account_key", None)
    source = f"{where} connection string"
    auth = AzureAuth(
        client.account_name or "",
        account_key=key,
        sas_token=sas or None,
        source=source,
    )
    return auth, endpoint.rstrip("/")
