"""``open_storage``: the one place that turns a URL into a backend.

URL forms: a path or ``file://``; ``http(s)://``; ``s3://bucket[/prefix]``;
``gs://bucket[/prefix]``; ``az://container[/prefix]`` (and ``abfs://``);
``hf://datasets/org/name[@revision][/path]``. Everything the backends need from the
environment arrives as arguments (``settings``, ``aws_env``: the storage variables from
``Settings.aws_env()``), so this module never reads ``os.environ`` itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from ..config import Settings, parse_size
from ..errors import ConfigError
from .base import UPLOAD_PART_BYTES, UPLOAD_THRESHOLD_BYTES, Storage
from .http import HttpStorage
from .local import LocalStorage
from .transport import header_option, verify_tls

__all__ = [
    "AZURE_OPTION_KEYS",
    "GCS_OPTION_KEYS",
    "HF_OPTION_KEYS",
    "S3_OPTION_KEYS",
    "open_storage",
]

#: storage_options keys understood by the S3 backend.
S3_OPTION_KEYS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "profile",
        "anon",
        "verify",
        "addressing_style",
        "multipart_threshold",
        "part_size",
    }
)
_HTTP_OPTION_KEYS = frozenset({"verify", "headers"})
#: storage_options keys understood by the GCS backend.
GCS_OPTION_KEYS = frozenset({"endpoint_url", "token", "key_file", "anon", "verify"})
#: storage_options keys understood by the Azure backend.
AZURE_OPTION_KEYS = frozenset(
    {
        "connection_string",
        "account_name",
        "account_key",
        "sas_token",
        "credential",
        "anon",
        "endpoint_url",
        "verify",
        "multipart_threshold",
        "part_size",
    }
)
_AZ_CONTAINER_RE = re.compile(r"^(\$root|[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62})$")
#: storage_options keys understood by the Hugging Face backend.
HF_OPTION_KEYS = frozenset({"token", "endpoint_url", "verify"})
_HF_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,95}$")
_GCS_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$", re.IGNORECASE)


def open_storage(
    url: str,
    settings: Settings,
    storage_options: Mapping[str, Any] | None = None,
    aws_env: Mapping[str, str] | None = None,
) -> Storage:
    """The backend for ``url``. Creating it does no I/O; the first call connects.

    Args:
        url: ``/local/dir``, ``file:///local/dir``, ``http(s)://host/path`` or
            ``s3://bucket[/prefix]``.
        settings: timeouts, connection limit and TLS default.
        storage_options: per-backend options (see docs/storage.md); override settings.
        aws_env: the ``AWS_*`` variables (``Settings.aws_env()``), for S3 endpoint/region.

    Raises:
        ConfigError: unknown scheme, malformed URL or unknown option; names the URL.
    """
    options = dict(storage_options or {})
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"storage URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):
        return _open_local(url, parts.path if scheme == "file" else url, parts.netloc, options)
    if scheme in ("http", "https"):
        _check_options(options, _HTTP_OPTION_KEYS, url)
        if not parts.hostname:
            raise ConfigError(f"malformed URL {url!r}: no host")
        if parts.username or parts.password:
            raise ConfigError(
                f"malformed URL {_redact(url)!r}: credentials in URLs are not supported"
            )
        return HttpStorage(
            url.rstrip("/"),
            settings,
            verify=verify_tls(settings, options),
            headers=header_option(options, url),
        )
    if scheme in ("s3", "s3a"):
        return _open_s3(url, parts.netloc, parts.path, settings, options, aws_env or {})
    if scheme in ("gs", "gcs"):
        return _open_gcs(url, parts.netloc, parts.path, settings, options, aws_env or {})
    if scheme in ("az", "abfs", "abfss"):
        return _open_azure(url, parts.netloc, parts.path, settings, options, aws_env or {})
    if scheme == "hf":
        return _open_hf(url, parts.netloc, parts.path, settings, options, aws_env or {})
    raise ConfigError(
        f"unsupported storage URL {_redact(url)!r}: scheme {scheme!r} is not "
        "one of file, http, https, s3, gs, az, abfs, abfss, hf"
    )


def _open_local(url: str, path: str, netloc: str, options: Mapping[str, Any]) -> Storage:
    _check_options(options, frozenset(), url)
    if netloc not in ("", "localhost"):
        raise ConfigError(f"malformed URL {url!r}: file:// URLs must be local (file:///path)")
    if not path:
        raise ConfigError(f"malformed URL {url!r}: no path")
    return LocalStorage(unquote(path), url=url.rstrip("/") or url)


def _open_s3(
    url: str,
    bucket: str,
    path: str,
    settings: Settings,
    options: Mapping[str, Any],
    aws_env: Mapping[str, str],
) -> Storage:
    _check_options(options, S3_OPTION_KEYS, url)
    try:  # botocore (signing, credentials) comes with the optional "s3" extra
        from .s3 import S3Storage
        from .s3_auth import S3Signer
    except ImportError as exc:
        raise ConfigError(
            f"{url}: s3:// needs botocore; install it with pip install 'asynccache[s3]'"
        ) from exc
    if not bucket or "@" in bucket or ":" in bucket or not _BUCKET_RE.match(bucket):
        raise ConfigError(f"malformed S3 URL {url!r}: expected s3://bucket[/prefix]")
    prefix = unquote(path).strip("/")
    if any(p in ("", ".", "..") for p in prefix.split("/")) and prefix:
        raise ConfigError(f"malformed S3 URL {url!r}: empty or relative path segment")
    region = str(
        options.get("region_name")
        or aws_env.get("AWS_REGION")
        or aws_env.get("AWS_DEFAULT_REGION")
        or "us-east-1"
    )
    endpoint = (
        options.get("endpoint_url")
        or aws_env.get("AWS_ENDPOINT_URL_S3")
        or aws_env.get("AWS_ENDPOINT_URL")
    )
    style = str(options.get("addressing_style", "auto"))
    if style not in ("auto", "path", "virtual"):
        raise ConfigError(f"addressing_style must be auto, path or virtual, got {style!r}")
    if endpoint:
        ep = urlsplit(str(endpoint))
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise ConfigError(f"endpoint_url {endpoint!r} for {url} must be http(s)://host")
        endpoint = f"{ep.scheme}://{ep.netloc}"
        path_style = style != "virtual"
    else:
        endpoint = f"https://s3.{region}.amazonaws.com"
        path_style = style == "path" or (style == "auto" and "." in bucket)
    return S3Storage(
        f"s3://{bucket}" + (f"/{prefix}" if prefix else ""),
        bucket=bucket,
        prefix=prefix,
        endpoint=str(endpoint),
        path_style=path_style,
        signer=S3Signer(options, aws_env, region),
        settings=settings,
        verify=verify_tls(settings, options),
        multipart_threshold=_size_option(
            options, "multipart_threshold", UPLOAD_THRESHOLD_BYTES, url
        ),
        part_size=_size_option(options, "part_size", UPLOAD_PART_BYTES, url),
    )


def _open_gcs(
    url: str,
    bucket: str,
    path: str,
    settings: Settings,
    options: Mapping[str, Any],
    env: Mapping[str, str],
) -> Storage:
    _check_options(options, GCS_OPTION_KEYS, url)
    try:  # google-auth (credentials chain) comes with the optional "gcs" extra
        import google.auth  # noqa: F401

        from .gcs import GCS_ENDPOINT, GcsStorage
        from .gcs_auth import GcsAuth
    except ImportError as exc:
        raise ConfigError(
            f"{url}: gs:// needs google-auth; install it with pip install 'asynccache[gcs]'"
        ) from exc
    if not bucket or "@" in bucket or ":" in bucket or not _GCS_BUCKET_RE.match(bucket):
        raise ConfigError(f"malformed GCS URL {url!r}: expected gs://bucket[/prefix]")
    prefix = _prefix(url, path)
    endpoint = options.get("endpoint_url") or env.get("STORAGE_EMULATOR_HOST")
    if endpoint:
        text = str(endpoint)
        if "://" not in text:  # Google's clients accept host:port
            text = "http://" + text
        ep = urlsplit(text)
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise ConfigError(f"GCS endpoint {endpoint!r} for {url} must be http(s)://host[:port]")
        endpoint = f"{ep.scheme}://{ep.netloc}"
    return GcsStorage(
        f"gs://{bucket}" + (f"/{prefix}" if prefix else ""),
        bucket=bucket,
        prefix=prefix,
        endpoint=str(endpoint or GCS_ENDPOINT),
        auth=GcsAuth(options, emulator=bool(endpoint)),
        settings=settings,
        verify=verify_tls(settings, options),
    )


def _open_azure(
    url: str,
    netloc: str,
    path: str,
    settings: Settings,
    options: Mapping[str, Any],
    env: Mapping[str, str],
) -> Storage:
    _check_options(options, AZURE_OPTION_KEYS, url)
    try:  # the SDK (signing, connection strings) comes with the optional "azure" extra
        import azure.storage.blob  # noqa: F401

        from . import azure_auth
        from .azure import AzureStorage
    except ImportError as exc:
        raise ConfigError(
            f"{url}: az:// needs azure-storage-blob and azure-identity; install them with "
            "pip install 'asynccache[azure]'"
        ) from exc
    container, _, host = netloc.partition("@")
    account_hint = host.split(".", 1)[0] if host else None
    if not _AZ_CONTAINER_RE.match(container) or (host and not account_hint):
        raise ConfigError(
            f"malformed Azure URL {url!r}: expected az://container[/prefix] or "
            "abfs://container@account.dfs.core.windows.net[/prefix]"
        )
    prefix = _prefix(url, path)
    auth, conn_endpoint = azure_auth.resolve(options, env, account_hint, url)
    endpoint = options.get("endpoint_url") or conn_endpoint
    if endpoint:
        ep = urlsplit(str(endpoint))
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise ConfigError(
                f"Azure endpoint {endpoint!r} for {url} must be http(s)://host[:port][/account]"
            )
        endpoint = str(endpoint).rstrip("/")
    else:
        endpoint = f"https://{auth.account}.blob.core.windows.net"
    shown = f"{urlsplit(url).scheme.lower()}://{netloc}" + (f"/{prefix}" if prefix else "")
    return AzureStorage(
        shown,
        container=container,
        prefix=prefix,
        endpoint=str(endpoint),
        auth=auth,
        settings=settings,
        verify=verify_tls(settings, options),
        multipart_threshold=_size_option(
            options, "multipart_threshold", UPLOAD_THRESHOLD_BYTES, url
        ),
        part_size=_size_option(options, "part_size", UPLOAD_PART_BYTES, url),
    )


def _open_hf(
    url: str,
    kind: str,
    path: str,
    settings: Settings,
    options: Mapping[str, Any],
    env: Mapping[str, str],
) -> Storage:
    _check_options(options, HF_OPTION_KEYS, url)
    try:  # resolve URLs as huggingface_hub does: the optional "hf" extra
        from .hf import HF_ENDPOINT, HfStorage
    except ImportError as exc:
        raise ConfigError(
            f"{url}: hf:// needs huggingface_hub; install it with pip install 'asynccache[hf]'"
        ) from exc
    segments = path.strip("/").split("/") if path.strip("/") else []
    if kind != "datasets" or len(segments) < 2:
        raise ConfigError(
            f"malformed Hugging Face URL {url!r}: expected hf://datasets/org/name[@revision][/path]"
        )
    org, name_rev, rest = segments[0], segments[1], segments[2:]
    name, at, revision = name_rev.partition("@")
    revision = unquote(revision) if at else "main"
    if not _HF_NAME_RE.match(org) or not _HF_NAME_RE.match(name) or not revision.strip():
        raise ConfigError(f"malformed Hugging Face URL {url!r}: bad repository or revision")
    prefix = _prefix(url, "/".join(rest))
    endpoint = options.get("endpoint_url") or env.get("HF_ENDPOINT") or HF_ENDPOINT
    ep = urlsplit(str(endpoint))
    if ep.scheme not in ("http", "https") or not ep.hostname:
        raise ConfigError(f"Hub endpoint {endpoint!r} for {url} must be http(s)://host[:port]")
    token = options.get("token")
    source: str | None = None
    if token is False:
        token = None
    elif token is not None:
        if not isinstance(token, str) or not token:
            raise ConfigError(f"storage option 'token' for {url} must be a non-empty str or False")
        source = "storage_options token"
    elif env.get("HF_TOKEN"):
        token, source = env["HF_TOKEN"], "HF_TOKEN"
    shown = f"hf://datasets/{org}/{name_rev}" + (f"/{prefix}" if prefix else "")
    return HfStorage(
        shown,
        repo_id=f"{org}/{name}",
        revision=revision,
        prefix=prefix,
        endpoint=str(endpoint).rstrip("/"),
        token=token,
        token_source=source,
        token_lookup=options.get("token") is None and not env.get("HF_TOKEN"),
        settings=settings,
        verify=verify_tls(settings, options),
    )


def _prefix(url: str, path: str) -> str:
    prefix = unquote(path).strip("/")
    if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
        raise ConfigError(f"malformed URL {url!r}: empty or relative path segment")
    return prefix


def _size_option(options: Mapping[str, Any], name: str, default: int, url: str) -> int:
    value = options.get(name, default)
    try:
        size = parse_size(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"storage option {name}={value!r} for {url} is not a size") from exc
    if size <= 0:
        raise ConfigError(f"storage option {name} for {url} must be > 0, got {size}")
    return size


def _check_options(options: Mapping[str, Any], known: frozenset[str], url: str) -> None:
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"unknown storage option(s) {unknown} for {_redact(url)}; known: "
            f"{sorted(known) or 'none'}"
        )


def _redact(url: str) -> str:
    """``url`` without any ``user:password@`` part."""
    return re.sub(r"//[^/@]*@", "//***@", url)
