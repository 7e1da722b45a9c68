"""Images kept as written against the lossless path: bytes stored and read throughput.

A sample of natural-looking photos (``asynccache.testing.photos``, JPEG quality 90) is
written twice through ``ChunkWriter``: once as ``Image.open(path)`` (the JPEG's bytes are
kept), once as the same pixels made in memory (``Image.fromarray``: encoded losslessly as
PNG, the only path before kept bytes). Reported: bytes stored, and the read of every item
decoded to pixels (``np.asarray``), best of ``--reps``, beside the load average.

    .venv/bin/python benchmarks/probes/image_bytes.py --images 200 --size 500x375
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from asynccache.cache import indexfile
from asynccache.read.reader import Reader
from asynccache.testing.photos import jpeg_bytes
from asynccache.write.writer import ChunkWriter, merge_dir


def write(directory: Path, images: list[Image.Image]) -> int:
    w = ChunkWriter(str(directory), 0)
    for i, img in enumerate(images):
        w.add(i, {"image": img, "label": i % 10})
    w.finish()
    merge_dir(str(directory), [0])
    return sum(p.stat().st_size for p in directory.glob("chunk-*.bin"))


def read_all(directory: Path, reps: int) -> float:
    idx = indexfile.read_dir(str(directory))
    r = Reader(idx, lambda ci, e: str(directory / e.filename))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(idx.total_items):
            np.asarray(r[i]["image"])
        best = min(best, time.perf_counter() - t0)
    r.close()
    return idx.total_items / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--size", default="500x375", help="WxH of each photo")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    w, h = (int(v) for v in a.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = []
        for i in range(a.images):
            p = root / f"{i}.jpg"
            p.write_bytes(jpeg_bytes(i, w, h))
            paths.append(p)
        jpeg_total = sum(p.stat().st_size for p in paths)
        t0 = time.perf_counter()
        kept = write(root / "kept", [Image.open(p) for p in paths])
        t_kept = time.perf_counter() - t0
        pixels = [Image.fromarray(np.asarray(Image.open(p))) for p in paths]
        t0 = time.perf_counter()
        png = write(root / "png", pixels)
        t_png = time.perf_counter() - t0
        r_kept = read_all(root / "kept", a.reps)
        r_png = read_all(root / "png", a.reps)
    print(
        f"{a.images} photos {w}x{h}, JPEG q90 files {jpeg_total / 1e6:.2f} MB; load {os.getloadavg()[0]:.1f}"
    )
    print("| path | stored MB | x JPEG files | write s | read+decode images/s |")
    print("|---|---|---|---|---|")
    print(
        f"| kept JPEG bytes | {kept / 1e6:.2f} | {kept / jpeg_total:.2f} | {t_kept:.2f} | {r_kept:.0f} |"
    )
    print(
        f"| lossless PNG | {png / 1e6:.2f} | {png / jpeg_total:.2f} | {t_png:.2f} | {r_png:.0f} |"
    )
    print(f"PNG / kept: {png / kept:.1f}x the bytes, kept decodes {r_kept / r_png:.2f}x as fast")


if __name__ == "__main__":
    main()
