"""The status/body -> error table, as a pure function (no server needed)."""

from __future__ import annotations

import email.utils
import time
from pathlib import Path

import pytest

from asynccache.errors import (
    AuthError,
    ConfigError,
    ObjectNotFoundError,
    StorageError,
    ThrottledError,
    TransientError,
)
from asynccache.storage import LocalStorage
from asynccache.storage.errmap import error_code, parse_retry_after, status_error

URL = "s3://bkt/ds/k"


def _xml(code: str) -> bytes:
    return f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>".encode()


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (404, b"", ObjectNotFoundError),
        (404, _xml("NoSuchBucket"), ObjectNotFoundError),
        (400, _xml("NoSuchKey"), ObjectNotFoundError),
        (403, _xml("SignatureDoesNotMatch"), AuthError),
        (401, b"", AuthError),
        (400, _xml("InvalidAccessKeyId"), AuthError),
        (503, _xml("SlowDown"), ThrottledError),
        (503, b"", ThrottledError),
        (500, _xml("SlowDown"), ThrottledError),
        (503, _xml("ServerBusy"), ThrottledError),
        (500, b"oops", TransientError),
        (500, _xml("InternalError"), TransientError),
        (429, b"", ThrottledError),
        (400, _xml("InvalidArgument"), StorageError),
    ],
)
def test_status_table(status: int, body: bytes, kind: type[StorageError]) -> None:
    err = status_error(status, URL, body=body, credential_source="storage_options")
    assert type(err) is kind
    assert URL in str(err) and err.url == URL


def test_auth_error_names_the_source() -> None:
    err = status_error(403, URL, credential_source="botocore shared-credentials-file")
    assert "shared-credentials-file" in str(err)


def test_wrong_region_hint() -> None:
    assert "region_name" in str(status_error(301, URL, body=_xml("PermanentRedirect")))


def test_retry_after_forms() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    value = parse_retry_after(later)
    assert value is not None and 50 < value <= 61
    err = status_error(503, URL, headers={"Retry-After": "4"})
    assert isinstance(err, TransientError) and err.retry_after == 4.0


def test_error_code_parsing() -> None:
    assert error_code(_xml("NoSuchKey")) == "NoSuchKey"
    assert error_code(b"not xml") is None
    assert error_code(b"<broken") is None


def test_local_path_refuses_escaping_keys(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with pytest.raises(ConfigError):
        storage.local_path("../outside")
