"""Child-process bodies for tests/test_fork_read.py (importable, so spawn can run them)."""

from __future__ import annotations

from typing import Any

_WAIT_S = 60.0


def read_all(url: str, cache_dir: str, options: dict, out: Any, go: Any) -> None:
    """Open the dataset anew in this process, read every item, report, then stay alive."""
    try:
        from asynccache.torch.streaming import StreamingDataset

        ds = StreamingDataset(url, cache_dir=cache_dir, storage_options=options)
        out.put(("ok", [ds[i]["name"] for i in range(ds.num_items)]))
    except BaseException as exc:  # report, don't hang the parent
        out.put(("error", repr(exc)))
    go.wait(_WAIT_S)


def take_locks(ds: Any, out: Any, go: Any) -> None:
    """Take the dataset's mutexes (bounded) and read an item, report, then stay alive."""
    try:
        got = []
        for lock in (ds.source._mu, ds.reader._lock):
            ok = lock.acquire(timeout=5.0)
            got.append(ok)
            if ok:
                lock.release()
        out.put(("ok", got, ds[40]["name"], sorted(ds.reader._open)))
    except BaseException as exc:
        out.put(("error", repr(exc)))
    go.wait(_WAIT_S)
