"""A separate process that uses the cache like a DataLoader worker would (run as a script).

    python mp_worker.py fetch URL CACHE_DIR SPECS_JSON THREADS SEED
    python mp_worker.py read  URL CACHE_DIR SPECS_JSON BUDGET ROUNDS SEED

``fetch``: THREADS threads each ensure every chunk (own shuffled order) and check bytes.
``read``: for ROUNDS passes in a shuffled order: ensure, pin, read and verify, unpin.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

import xxhash

from asynccache.bridge import get_loop_thread
from asynccache.cache import ChunkStore, dataset_dir
from asynccache.config import Settings
from asynccache.download import ChunkSpec, Downloader
from asynccache.storage import open_storage


def _check(path: str, spec: ChunkSpec) -> None:
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != spec.size or xxhash.xxh3_64(data).hexdigest() != spec.checksum:
        raise SystemExit(f"corrupt chunk {spec.name} at {path}")


def main(argv: list[str]) -> int:
    mode, url, cache_dir, specs_json = argv[:4]
    specs = [ChunkSpec(**s) for s in json.loads(specs_json)]
    budget = int(argv[4]) if mode == "read" else 1 << 40
    settings = Settings(
        cache_dir=cache_dir,
        max_cache_bytes=budget,
        retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.1,
        timeout_s=30.0,
        part_bytes=64 << 20,
        prefetch_chunks=0,
    )
    lt = get_loop_thread()
    storage = open_storage(url, settings)
    lt.register_closer(storage.close)
    store = ChunkStore(
        dataset_dir(cache_dir, "test-dataset", "v1"), max_cache_bytes=budget, lock_timeout_s=60
    )
    dl = Downloader(storage, store, settings, loop_thread=lt)
    errors: list[BaseException] = []

    if mode == "fetch":
        n_threads, seed = int(argv[4]), int(argv[5])

        def run(i: int) -> None:
            try:
                order = specs[:]
                random.Random(seed * 100 + i).shuffle(order)
                for spec in order:
                    _check(dl.ensure(spec.name, spec.size, spec.checksum).result(60), spec)
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(i,), name=f"reader-{i}", daemon=True)
            for i in range(n_threads)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    else:
        rounds, seed = int(argv[5]), int(argv[6])
        rng = random.Random(seed)
        for _ in range(rounds):
            order = specs[:]
            rng.shuffle(order)
            for spec in order:
                for _attempt in range(10):  # evicted between ensure and pin: fetch again
                    dl.ensure(spec.name, spec.size, spec.checksum).result(60)
                    path = store.pin(spec.name)
                    if path is not None:
                        break
                else:
                    raise SystemExit(f"could not pin {spec.name}")
                try:
                    _check(path, spec)
                    time.sleep(0.005)
                finally:
                    store.unpin(spec.name)
    print(json.dumps({"pid": os.getpid(), "stats": str(dl.stats)}), flush=True)
    dl.close()
    store.close()
    if errors:
        raise errors[0]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
