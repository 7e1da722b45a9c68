"""The ``asynccache`` command: inspect, verify, upload and prefetch datasets; see and
clear the local chunk cache (``cache ls | du | clear``).

Exit codes: 0 success; 1 ``verify`` found bad chunks; 2 the command could not run (bad
arguments, missing dataset, storage or data error). Errors print as one line
``asynccache: error: <message>`` on stderr; ``--debug`` adds the traceback. The command
is a thin face over the library: every check and transfer lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import statistics
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ._version import __version__
from .cache.indexfile import read_path, write_dir
from .errors import AsyncCacheError, ConfigError, DataError, ObjectNotFoundError
from .format import INDEX_NAME
from .format.columns import sidecar_name
from .format.index import VERSION as INDEX_VERSION
from .format.index import VERSION_COLUMNS as INDEX_VERSION_COLUMNS

__all__ = ["main"]

PROG = "asynccache"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit code.

    Args:
        argv: the arguments after the program name.

    Returns:
        0 on success, 1 when ``verify`` finds bad chunks, 2 when the command cannot run.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        result: int = args.func(args)
        return result
    except (AsyncCacheError, OSError) as exc:
        # OSError too: an unreadable directory is a user's problem, not a crash.
        if args.debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


# -- subcommands ---------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    from .read.source import DatasetSource, is_remote, local_dir

    if not is_remote(args.url):
        _require_index(local_dir(args.url))
    index = DatasetSource(args.url, storage_options=_storage_options(args.storage_option)).index
    sizes = index.bytes_per_chunk.tolist()
    items = index.items_per_chunk.tolist()
    rows = [
        ("dataset", args.url),
        ("format version", str(INDEX_VERSION_COLUMNS if index.mapped else INDEX_VERSION)),
        ("items", str(index.total_items)),
        ("chunks", str(len(index.chunks))),
        ("bytes", _bytes(index.total_bytes)),
        ("chunk bytes", _spread(sizes, _bytes)),
        ("chunk items", _spread(items, str)),
        ("writer config", json.dumps(dict(index.config), sort_keys=True, default=str)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .read.reader import Reader, map_chunk
    from .read.source import is_remote, local_dir

    if is_remote(args.dir):
        raise ConfigError(
            f"verify checks a local dataset directory, got {args.dir!r}; "
            "download it first (asynccache prefetch) or verify the source directory"
        )
    root = local_dir(args.dir)
    index_path = _require_index(root)
    index = read_path(index_path)

    def resolve(ci: int, entry: Any) -> str:
        return os.path.join(root, entry.filename)

    # Checksums are checked once by map_chunk below; the reader only decodes.
    reader = Reader(index, resolve, verify=False, allow_pickle=args.allow_pickle, max_open=1)
    bad = decoded = 0
    for ci, entry in enumerate(index.chunks):
        try:
            map_chunk(resolve(ci, entry), entry, verify=True)
            for pos in range(entry.items):
                reader.read(ci, pos)
                decoded += 1
        except (DataError, ObjectNotFoundError) as exc:
            bad += 1
            print(f"BAD {entry.filename}: {_one_line(exc)}")
        finally:
            reader.release(ci)
    reader.close()
    ok = len(index.chunks) - bad
    print(
        f"{len(index.chunks)} chunks checked: {ok} ok, {bad} bad; "
        f"{decoded} of {index.total_items} items decoded"
    )
    return 1 if bad else 0


def _reindex(args: argparse.Namespace) -> int:
    from .read.source import is_remote, local_dir

    if is_remote(args.dir):
        raise ConfigError(
            f"reindex rewrites the index of a local dataset directory, got {args.dir!r}; "
            "reindex the local copy, then upload it"
        )
    root = local_dir(args.dir)
    path = _require_index(root)
    index = read_path(path)
    if index.mapped:
        print(f"{path}: already version {INDEX_VERSION_COLUMNS} ({len(index.chunks)} chunks)")
        return 0
    new = write_dir(root, index)
    side = sidecar_name(new.checksum.split(":", 1)[1])
    print(
        f"{path}: version {INDEX_VERSION} -> {INDEX_VERSION_COLUMNS}, {len(new.chunks)} chunks, "
        f"columns in {side}"
    )
    return 0


def _upload(args: argparse.Namespace) -> int:
    from .write.upload import upload

    s = upload(args.dir, args.url, _storage_options(args.storage_option))
    print(
        f"uploaded {s.objects} objects ({_bytes(s.bytes)}) to {args.url} in {s.seconds:.1f}s; "
        f"{s.skipped} already present"
    )
    return 0


def _prefetch(args: argparse.Namespace) -> int:
    from .read.prefetch import prefetch
    from .read.source import is_remote

    if not is_remote(args.url):
        _require_index(args.url.removeprefix("file://"))
        print(f"{args.url} is local: read in place, nothing to fetch")
        return 0
    s = prefetch(args.url, args.cache_dir, _storage_options(args.storage_option))
    print(
        f"prefetched {s.chunks_fetched} chunks ({_bytes(s.bytes)}), {s.hits} already cached, "
        f"{s.retries} retries, {_bytes(int(s.bytes_per_s))}/s"
    )
    return 0


def _cache_ls(args: argparse.Namespace) -> int:
    cache_dir, dirs = _cache_dirs(args)
    rows = [("DATASET", "CHUNKS", "BYTES", "PINNED", "DOWNLOADING", "LAST USED")]
    for name, path in dirs:
        chunks, partial = _cache_files(path)
        used = max((st.st_mtime for _, st in chunks), default=None)
        pinned = sum(1 for f, _ in chunks if _in_use(os.path.join(path, f)))
        rows.append(
            (
                name,
                str(len(chunks)),
                _bytes(sum(st.st_size for _, st in chunks)),
                str(pinned),
                str(len(partial)),
                "-" if used is None else _when(used),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if not dirs:
        print(f"(nothing cached in {cache_dir})")
    return 0


def _cache_du(args: argparse.Namespace) -> int:
    from .cache.usage import fs_free
    from .config import Settings

    cache_dir, dirs = _cache_dirs(args)
    total = 0
    for name, path in dirs:
        chunks, partial = _cache_files(path)
        size = sum(st.st_size for _, st in chunks) + sum(
            max(st.st_blocks * 512, st.st_size) for _, st in partial
        )
        total += size
        print(f"{_bytes(size):>10}  {name}")
    budget = Settings.from_env().max_cache_bytes
    free = _bytes(fs_free(cache_dir)) if os.path.isdir(cache_dir) else "-"
    print(
        f"{_bytes(total):>10}  total in {len(dirs)} dataset(s) under {cache_dir} "
        f"(budget {_bytes(budget)}, {free} free on its disk)"
    )
    return 0


def _cache_clear(args: argparse.Namespace) -> int:
    from .cache.layout import sweep_orphans

    _cache_dir, dirs = _cache_dirs(args)
    removed = freed = 0
    skipped: list[str] = []
    for _name, path in dirs:
        chunks, _partial = _cache_files(path)
        for f, st in chunks:
            full = os.path.join(path, f)
            if _remove_unpinned(full):
                removed += 1
                freed += st.st_size
            elif os.path.exists(full):
                skipped.append(full)
        sweep_orphans(path)  # downloads whose process died; live ones keep their lock
        skipped += [os.path.join(path, f) for f, _ in _cache_files(path)[1]]
    print(f"removed {removed} chunk(s) ({_bytes(freed)}) from {len(dirs)} dataset(s)")
    if skipped:
        print(f"skipped {len(skipped)} file(s) in use by another process (pinned or downloading):")
        for path in skipped:
            print(f"  {path}")
    return 0


def _cache_dirs(args: argparse.Namespace) -> tuple[str, list[tuple[str, str]]]:
    """The cache directory and its dataset directories ``(label, path)``: all of them, or
    the one of ``--dataset URL`` (found from the URL and its index's checksum)."""
    from .cache.layout import dataset_dir, is_dataset_dir
    from .config import Settings

    cache_dir = args.cache_dir or Settings.from_env().cache_dir
    if args.dataset is not None:
        from .read.source import DatasetSource

        src = DatasetSource(
            args.dataset,
            cache_dir=cache_dir,
            storage_options=_storage_options(args.storage_option),
        )
        if not src.remote:
            raise ConfigError(f"{args.dataset} is local: it is read in place, never cached")
        path = str(dataset_dir(cache_dir, src.url, src.index.checksum))
        return cache_dir, ([(args.dataset, path)] if is_dataset_dir(path) else [])
    try:
        entries = sorted(os.scandir(cache_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return cache_dir, []
    return cache_dir, [
        (e.name, e.path)
        for e in entries
        if e.is_dir(follow_symlinks=False) and is_dataset_dir(e.path)
    ]


def _cache_files(path: str) -> tuple[list[tuple[str, os.stat_result]], list[tuple[str, Any]]]:
    """A dataset directory's published chunks and downloads in progress, with their stats
    (only names the cache creates; nothing else is looked at)."""
    from .cache.layout import is_chunk_name, is_chunk_temp_name

    chunks, partial = [], []
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return [], []
    for e in entries:
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            if is_chunk_name(e.name):
                chunks.append((e.name, e.stat(follow_symlinks=False)))
            elif is_chunk_temp_name(e.name):
                partial.append((e.name, e.stat(follow_symlinks=False)))
        except FileNotFoundError:
            continue
    return sorted(chunks), sorted(partial)


def _in_use(path: str) -> bool:
    """True when another process pins ``path`` (holds its shared flock)."""
    from .cache.locks import try_lock

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not try_lock(fd, exclusive=True):
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _remove_unpinned(path: str) -> bool:
    """Unlink a published chunk unless a process pins it: as the cache's evictor does,
    only under an exclusive, non-blocking flock (a pin holds a shared one)."""
    from .cache.locks import try_lock

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not try_lock(fd, exclusive=True):
            return False
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)  # (drops the lock)


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


# -- helpers -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    # Every subcommand also accepts --debug; SUPPRESS keeps a subcommand's default from
    # overriding a --debug given before the subcommand name.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    storage = argparse.ArgumentParser(add_help=False)
    storage.add_argument(
        "--storage-option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option (endpoint_url, region_name, verify, ...); repeatable",
    )
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect, verify, upload and prefetch asynccache datasets."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", parents=[common, storage], help="print a dataset's index summary")
    p.add_argument("url", metavar="PATH_OR_URL")
    p.set_defaults(func=_inspect)

    p = sub.add_parser(
        "verify", parents=[common], help="check every chunk and item of a local dataset"
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="decode pickled leaves (only for data you trust: unpickling can run code)",
    )
    p.set_defaults(func=_verify)

    p = sub.add_parser(
        "reindex",
        parents=[common],
        help="rewrite a local dataset's version-1 index.json as version 2 (mapped columns)",
    )
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=_reindex)

    p = sub.add_parser(
        "upload", parents=[common, storage], help="upload a dataset; index.json last"
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("url", metavar="URL")
    p.set_defaults(func=_upload)

    p = sub.add_parser(
        "prefetch", parents=[common, storage], help="download a remote dataset into the cache"
    )
    p.add_argument("url", metavar="URL")
    p.add_argument(
        "--cache-dir", default=None, help="local cache directory (default ASYNCCACHE_CACHE_DIR)"
    )
    p.set_defaults(func=_prefetch)

    cache = sub.add_parser("cache", help="see and clear the local chunk cache")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--cache-dir", default=None, help="the cache directory (default ASYNCCACHE_CACHE_DIR)"
    )
    where.add_argument(
        "--dataset", default=None, metavar="URL", help="only the cached chunks of this dataset"
    )
    for name, func, text in (
        ("ls", _cache_ls, "list the cached datasets: chunks, bytes, pinned, last used"),
        ("du", _cache_du, "bytes the cache holds, per dataset and in total"),
        ("clear", _cache_clear, "delete cached chunks no process is using; say what was kept"),
    ):
        c = csub.add_parser(name, parents=[common, storage, where], help=text)
        c.set_defaults(func=func)
    return parser


def _storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["verify=false", "port=9000", "region_name=x"]`` -> ``{False, 9000, "x"}`` values.

    Raises:
        ConfigError: an entry has no ``=`` or an empty key.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = _option_value(raw)
    return out


def _option_value(raw: str) -> bool | int | str:
    low = raw.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(raw)
    except ValueError:
        return raw


def _require_index(root: str) -> str:
    """Path of ``root``'s ``index.json``; a missing one is an error naming the directory."""
    path = os.path.join(root, INDEX_NAME)
    if not os.path.isfile(path):
        what = "directory does not exist" if not os.path.isdir(root) else f"no {INDEX_NAME}"
        raise ObjectNotFoundError(f"{root}: not a dataset ({what})", url=root)
    return path


def _spread(values: Sequence[int], fmt: Any) -> str:
    if not values:
        return "-"
    mid = int(statistics.median(values))
    return f"min {fmt(min(values))}, median {fmt(mid)}, max {fmt(max(values))}"


def _bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact below 1 KiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
