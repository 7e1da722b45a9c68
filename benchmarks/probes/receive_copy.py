"""Receiving into a file: ``recv_into`` a reused buffer + ``pwrite``, against a shared mapping.

A forked sender streams ``--mib`` MiB over one loopback TCP connection; the receiver puts
them into a preallocated file, one way per run, and prints its own user and system CPU
(``getrusage``) and wall time:

* ``buf<KiB>``: ``recv_into`` a reused buffer of that size, then ``os.pwrite`` (two copies:
  what the S3 and HTTP backends' receive path does);
* ``mmap``: ``recv_into`` a shared writable mapping of the file (one copy; page faults and
  zero-filled pages instead);
* ``mmap-pop``: the same after ``MADV_POPULATE_WRITE`` (Linux 5.14+) pre-faults the mapping.

    python benchmarks/probes/receive_copy.py [--mib 512] [--rounds 5] [--ways buf1024 mmap mmap-pop]

The ways alternate within each round; medians and ranges are printed at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import socket
import statistics
import tempfile
import time

_MADV_POPULATE_WRITE = 23


def _send(srv: socket.socket, total: int) -> None:
    conn, _ = srv.accept()
    buf = os.urandom(1 << 20)
    sent = 0
    while sent < total:
        sent += conn.send(buf[: min(len(buf), total - sent)])
    conn.close()


def one(way: str, total: int, directory: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of receiving ``total`` bytes ``way``."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    pid = os.fork()
    if pid == 0:
        try:
            _send(srv, total)
        finally:
            os._exit(0)
    sock = socket.create_connection(srv.getsockname())
    fd, path = tempfile.mkstemp(dir=directory)
    os.posix_fallocate(fd, 0, total)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    pos = 0
    if way.startswith("buf"):
        size = int(way[3:]) << 10
        view = memoryview(bytearray(size))
        while pos < total:
            n = sock.recv_into(view, min(size, total - pos))
            if not n:
                break
            os.pwrite(fd, view[:n], pos)
            pos += n
    else:
        mapped = mmap.mmap(fd, total, access=mmap.ACCESS_WRITE)
        if way == "mmap-pop":
            mapped.madvise(_MADV_POPULATE_WRITE)
        view = memoryview(mapped)
        while pos < total:
            n = sock.recv_into(view[pos : pos + (4 << 20)])
            if not n:
                break
            pos += n
        view.release()
        mapped.close()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    os.waitpid(pid, 0)
    sock.close()
    srv.close()
    os.close(fd)
    os.unlink(path)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return cpu, t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ways", nargs="+", default=["buf1024", "mmap", "mmap-pop"])
    ap.add_argument("--dir", default=None, help="where the file goes (default: a temp dir)")
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {w: [] for w in args.ways}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for _ in range(args.rounds):
            for way in args.ways:
                results[way].append(one(way, args.mib << 20, directory))
    print(f"{args.mib} MiB over loopback, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for way, runs in results.items():
        cpus = [c for c, _ in runs]
        print(
            f"{way:>9}: CPU {statistics.median(cpus):.3f} s ({min(cpus):.3f}-{max(cpus):.3f}), "
            f"wall {statistics.median(w for _, w in runs):.3f} s"
        )


if __name__ == "__main__":
    main()
