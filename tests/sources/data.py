"""Real Parquet files and folders of files for the source tests, and putting them in a
bucket."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asynccache.bridge import get_loop_thread
from asynccache.config import Settings
from asynccache.storage import open_storage


def table(first: int, n: int) -> pa.Table:
    """Rows ``first .. first + n - 1``: each row's values follow from its id."""
    ids = np.arange(first, first + n, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "x": (ids * 0.5).astype(np.float32),
            "label": (ids % 7).astype(np.int32),
            "text": [f"row {i}" for i in ids.tolist()],
            "vec": [np.full(4, i % 5, dtype=np.float32) for i in ids.tolist()],
            "blob": [bytes([i % 251]) * (200 + i % 300) for i in ids.tolist()],
        }
    )


def write_parquet(root: Path, sizes: list[int], row_group: int = 40) -> list[Path]:
    """Files ``part-<k>.parquet`` (the third and later in ``sub/``) of ``sizes`` rows, ids
    counting on across files."""
    root.mkdir(parents=True, exist_ok=True)
    out, first = [], 0
    for k, n in enumerate(sizes):
        p = root / ("sub" if k >= 2 else "") / f"part-{k}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table(first, n), p, row_group_size=row_group)
        out.append(p)
        first += n
    return out


def expected(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "x": np.float32(i * 0.5),
        "label": i % 7,
        "text": f"row {i}",
        "vec": [float(i % 5)] * 4,
        "blob": bytes([i % 251]) * (200 + i % 300),
    }


def check_row(row: dict[str, Any], cols: list[str] | None = None) -> int:
    i = int(row["id"])
    want = expected(i)
    for k in cols or list(want):
        got = row[k]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == want[k], (k, got, want[k])
    return i


def put_dir(src: Path, url: str, options: dict[str, Any]) -> None:
    """Every file under ``src`` stored under ``url`` at its relative path."""
    storage = open_storage(url, Settings.from_env(), options)
    lt = get_loop_thread()
    try:
        for dirpath, _, files in os.walk(src):
            for name in files:
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, src).replace(os.sep, "/")
                lt.call(storage.upload(full, key), 60)
    finally:
        lt.call(storage.close(), 10)


def put_file(path: Path, url: str, key: str, options: dict[str, Any]) -> None:
    storage = open_storage(url, Settings.from_env(), options)
    lt = get_loop_thread()
    try:
        lt.call(storage.upload(str(path), key), 60)
    finally:
        lt.call(storage.close(), 10)


def delete(url: str, key: str, options: dict[str, Any]) -> None:
    storage = open_storage(url, Settings.from_env(), options)
    lt = get_loop_thread()
    try:
        lt.call(storage.delete(key), 60)
    finally:
        lt.call(storage.close(), 10)
