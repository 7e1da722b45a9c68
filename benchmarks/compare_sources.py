"""Data where it already lives, side by side: Parquet and a folder of JPEGs, asynccache and litdata.

``compare.py --sources`` runs this (in ``.venv-compare``: litdata with pyarrow and polars).
One SeaweedFS server on loopback, behind a counting proxy (``compare.Proxy``: the body bytes
each request was sent). Two sources, put in the bucket as they are:

* **Parquet**: ``--rows`` rows (``id`` int64, ``label`` int32, ``text`` ~100 B, ``vec``
  16 x float32) in ``--files`` files of row groups of ``--row-group`` rows. asynccache reads
  the prefix (``StreamingDataset(url)``: footers fetched and cached when the dataset is made);
  litdata indexes it first (``index_parquet_dataset``, on a local copy: its cloud indexing
  needs s3fs, which this environment's boto3 pin excludes; the index is then put beside the
  files) and reads it with ``ParquetLoader``. Both read every column.
* **Folder of JPEGs**: ``--images`` photos (``asynccache.testing.photos``, 256x192, JPEG
  quality 90) in ``train/<class>/``. asynccache: ``files="**/*.jpg"``, ``labels="dir"``;
  litdata: ``StreamingRawDataset`` (its files listed with boto3 through its ``indexer=``,
  for the same reason). Both decode each JPEG in the worker to a 64x64 RGB array.

Per library and source, ``--reps`` times: a cold epoch (fresh cache dir; the clock starts
before the dataset is made), a warm epoch (the same loader again), a shuffled cold epoch
(fresh cache dir). Reported: items/s, the time to the first batch, and the bytes fetched
from the store (through the proxy) over the bytes of the source; median (min-max).

    python benchmarks/compare.py --sources [--rows 200000] [--images 2000] [--workers 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

BUCKET = "sources"
CLASSES = 10


def _decode_jpeg(data: bytes) -> np.ndarray:
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (64, 64))
    return np.array(img.convert("RGB").resize((64, 64)))


def asynccache_image(key: str, data: bytes, label: int) -> tuple[np.ndarray, int]:
    return _decode_jpeg(data), label


def litdata_image(data: bytes) -> np.ndarray:
    return _decode_jpeg(data)


# -- the sources -------------------------------------------------------------------------
def write_parquet(root: Path, rows: int, files: int, row_group: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    per = -(-rows // files)
    for f in range(files):
        ids = np.arange(f * per, min(rows, (f + 1) * per), dtype=np.int64)
        rng = np.random.default_rng(f)
        t = pa.table(
            {
                "id": ids,
                "label": (ids % 100).astype(np.int32),
                "text": [f"row {i} " + "x" * int(80 + i % 40) for i in ids.tolist()],
                "vec": list(rng.standard_normal((len(ids), 16)).astype(np.float32)),
            }
        )
        pq.write_table(t, root / f"part-{f:04d}.parquet", row_group_size=row_group)
    return sum(p.stat().st_size for p in root.iterdir())


def write_images(root: Path, n: int) -> int:
    from asynccache.testing.photos import jpeg_bytes

    total = 0
    for i in range(n):
        d = root / "train" / f"class{i % CLASSES:02d}"
        d.mkdir(parents=True, exist_ok=True)
        data = jpeg_bytes(i, 256, 192)
        (d / f"{i:06d}.jpg").write_bytes(data)
        total += len(data)
    return total


def upload(client: Any, src: Path, prefix: str) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(src).as_posix()}")


# -- opening each library's loader -------------------------------------------------------
def open_asynccache(kind: str, url: str, opts: dict, cache: Path, shuffle: bool, a: Any) -> Any:
    from asynccache import CacheDataLoader, StreamingDataset

    kw: dict[str, Any] = {"columns": ["id", "label", "text", "vec"]}
    if kind == "images":
        kw = {"files": "**/*.jpg", "labels": "dir", "decode": asynccache_image}
    ds = StreamingDataset(url, cache_dir=cache, storage_options=opts, shuffle=shuffle, seed=1, **kw)
    return CacheDataLoader(ds, batch_size=a.batch, num_workers=a.workers)


def open_litdata(kind: str, url: str, opts: dict, cache: Path, shuffle: bool, a: Any) -> Any:
    import litdata
    from torch.utils.data import DataLoader

    lit_opts = {
        "aws_access_key_id": opts["aws_access_key_id"],
        "aws_secret_access_key": opts["aws_secret_access_key"],
        "endpoint_url": opts["endpoint_url"],
        "region_name": opts.get("region_name", "us-east-1"),
    }
    if kind == "parquet":
        from litdata.streaming.item_loader import ParquetLoader

        ds = litdata.StreamingDataset(
            url,
            cache_dir=str(cache),
            item_loader=ParquetLoader(),
            shuffle=shuffle,
            seed=1,
            storage_options=lit_opts,
        )
        # (its Parquet loader refuses forked workers: polars' thread pool)
        return litdata.StreamingDataLoader(
            ds,
            batch_size=a.batch,
            num_workers=a.workers,
            multiprocessing_context="spawn",
            worker_init_fn=lit_worker_init,
        )
    from litdata import StreamingRawDataset

    ds = StreamingRawDataset(
        url,
        cache_dir=str(cache),
        indexer=_boto3_indexer(lit_opts),
        storage_options=lit_opts,
        transform=litdata_image,
        cache_files=True,
    )
    return DataLoader(ds, batch_size=a.batch, num_workers=a.workers, shuffle=shuffle)


def _boto3_indexer(opts: dict) -> Any:
    from litdata.raw.indexer import BaseIndexer, FileMetadata

    class Boto3Indexer(BaseIndexer):
        def discover_files(self, input_dir: str, storage_options: Any) -> list[Any]:
            import boto3

            bucket, _, prefix = input_dir.removeprefix("s3://").partition("/")
            client = boto3.client("s3", **opts)
            out = []
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            ):
                for o in page.get("Contents", []):
                    if o["Key"].endswith(".jpg"):
                        out.append(FileMetadata(f"s3://{bucket}/{o['Key']}", o["Size"]))
            return out

    return Boto3Indexer()


def lit_worker_init(_: int) -> None:
    """In a spawned worker: litdata's obstore client must allow http:// again."""
    from compare import litdata_http

    litdata_http()


def batch_len(b: Any) -> int:
    if isinstance(b, dict):
        return batch_len(next(iter(b.values())))
    if isinstance(b, (list, tuple)):
        return batch_len(b[0]) if b and not isinstance(b[0], (str, bytes)) else len(b)
    return int(b.shape[0])


def epoch(loader: Iterable[Any], t0: float) -> tuple[int, float, float]:
    first, n = 0.0, 0
    for b in loader:
        if not n:
            first = time.perf_counter() - t0
        n += batch_len(b)
    return n, first, time.perf_counter() - t0


def fetched(proxy: Any) -> int:
    return sum(r[5] for r in proxy.take() if r[0] == "GET")


def med(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def run_sources(a: Any, store: Any, proxy: Any, client: Any, work: Path) -> None:
    from compare import litdata_http  # (this folder's)

    litdata_http()
    src = work / "src"
    sizes = {
        "parquet": write_parquet(src / "parquet", a.rows, a.files, a.row_group),
        "images": write_images(src / "images", a.images),
    }
    upload(client, src / "parquet", "parquet")
    upload(client, src / "images", "images")
    # litdata's Parquet index, made locally and put beside the files
    from litdata import index_parquet_dataset

    (work / "lit-index").mkdir()
    t = time.perf_counter()
    index_parquet_dataset(str(src / "parquet"), cache_dir=str(work / "lit-index"))
    lit_index_s = time.perf_counter() - t
    made = next(p for p in (work / "lit-index", src / "parquet") if (p / "index.json").exists())
    client.upload_file(str(made / "index.json"), BUCKET, "parquet/index.json")
    opts = dict(store.storage_options, endpoint_url=proxy.url)
    opens: dict[str, Callable[..., Any]] = {"asynccache": open_asynccache, "litdata": open_litdata}
    rows: list[str] = []
    for kind in ("parquet", "images"):
        url = f"s3://{BUCKET}/{kind}" + ("/" if kind == "images" else "")
        for lib, make in opens.items():
            got: dict[str, list[float]] = {}
            kept: tuple[Any, Path] = (None, work)
            for rep in range(a.reps):
                for mode in ("cold", "warm", "shuffled"):
                    if mode == "warm":
                        loader, cache = kept
                    else:
                        cache = work / f"cache-{lib}-{kind}-{rep}-{mode}"
                        shutil.rmtree(cache, ignore_errors=True)
                    fetched(proxy)  # start counting here
                    t0 = time.perf_counter()
                    try:
                        if mode != "warm":
                            loader = make(kind, url, opts, cache, mode == "shuffled", a)
                        n, first, total = epoch(loader, t0)
                    except Exception as exc:  # a library that can't read it: say so
                        print(f"{lib} {kind} {mode}: {type(exc).__name__}: {exc}"[:300])
                        got.setdefault(f"{mode} fail", []).append(1)
                        break
                    got.setdefault(f"{mode} items/s", []).append(n / total)
                    got.setdefault(f"{mode} first s", []).append(first)
                    got.setdefault(f"{mode} fetched", []).append(fetched(proxy) / sizes[kind])
                    got.setdefault(f"{mode} n", []).append(n)
                    if mode == "cold":
                        kept = (loader, cache)
            cells = [
                f"{med(got.get(f'{m} items/s', []))} | {med(got.get(f'{m} first s', []))} | "
                f"{med(got.get(f'{m} fetched', []))}"
                for m in ("cold", "warm", "shuffled")
            ]
            items = int(statistics.median(got.get("cold n", [0])))
            rows.append(f"| {kind} | {lib} | {items} | " + " | ".join(cells) + " |")
    print(
        f"\ncompare --sources: {a.rows} Parquet rows in {a.files} files "
        f"({sizes['parquet'] / 1e6:.1f} MB, row groups of {a.row_group}); {a.images} JPEGs "
        f"({sizes['images'] / 1e6:.1f} MB); batch {a.batch}, {a.workers} workers, {a.reps} reps, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; litdata's Parquet index took "
        f"{lit_index_s:.2f} s before its first epoch (asynccache's is inside its cold epoch)"
    )
    print(
        "\n| source | library | items | cold items/s | cold first batch s | cold fetched / "
        "source | warm items/s | warm first batch s | warm fetched / source | shuffled items/s "
        "| shuffled first batch s | shuffled fetched / source |"
    )
    print("|" + "---|" * 15)
    for r in rows:
        print(r)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", action="store_true", help="(as passed by compare.py)")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--row-group", type=int, default=10_000)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a, _ = ap.parse_known_args(argv)
    import boto3
    from compare import Proxy

    from asynccache.testing import ObjectStore

    with ObjectStore() as store, tempfile.TemporaryDirectory() as tmp:
        store.create_bucket(BUCKET)
        proxy = Proxy(str(store.endpoint_url), 0.0, 0)
        try:
            client = boto3.client("s3", **store.storage_options)
            run_sources(a, store, proxy, client, Path(tmp))
        finally:
            proxy.close()


if __name__ == "__main__":
    main()
