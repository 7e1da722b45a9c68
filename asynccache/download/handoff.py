"""Publishes a DataLoader worker leaves to its main process (docs/cache.md, "Read before
the publish ends").

A worker reads a chunk it downloaded once the chunk is verified, while the chunk's fsync
and rename run on a thread. At the end of its iteration it used to wait for them: torch
ends a worker a few seconds after the epoch, and a publish cut there was lost. The wait
sat on the epoch's critical path (an fsync waits for the journal commit, 0.2-0.4 s on a
busy disk) and held up the other workers' last batches, which the DataLoader hands out
in order.

Now the main process keeps a :class:`Keeper`: a thread listening on an abstract Unix
socket. At the end of its iteration a worker sends it, for every chunk still publishing,
duplicates of two descriptors (``SCM_RIGHTS``) with the chunk's two paths:

* the verified temporary file's: its open file description carries the writer's flock,
  so while the keeper holds it no sweeper takes the file, whatever becomes of the worker;
* the chunk's download lock's: another process asking for the chunk waits for it, then
  finds the published name (one GET per chunk per node, as before).

Once the keeper acknowledges, the worker ends its iteration without waiting, and its
exit does not wait either (the publish runs on a daemon thread). The keeper watches each
chunk: published by the worker (the final name reaches the same inode), or discarded by
it (the temporary name is gone: its publish failed), and it only lets go; the worker
dead with neither done, the keeper finishes the publish itself (fsync, rename, fsync of
the directory; the bytes were verified before the hand-off), then lets go. Only verified
files are ever handed over, so nothing unverified is published; a file the keeper gives
up on (past ``timeout_s``) keeps its pending entry in the ledger and is swept like any
dead writer's. The main process waits for what it keeps when a dataset closes and at
exit (bounded).

Linux only (abstract sockets, ``pidfd_open``); elsewhere nothing is handed over and the
worker waits as before.

Layer: stdlib, :mod:`asynccache.forksafe`, :mod:`asynccache.fsutil`, :mod:`asynccache.cache.layout`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time

from .. import forksafe
from ..cache.layout import is_chunk_temp_name, temp_final_name
from ..fsutil import fsync_dir

log = logging.getLogger(__name__)

_POLL_S = 0.005  # how often a kept chunk is looked at while its worker lives (a waiter
# for its download lock in another process waits up to this much longer)
ACK_S = 5.0  # a worker's wait for the keeper's acknowledgement
_MAX_MSG = 1 << 16


@dataclasses.dataclass
class Handed:
    """One chunk a worker hands over: its temporary and final paths and duplicates of
    the temporary file's and the download lock's descriptors (the sender closes them)."""

    tmp: str
    final: str
    durable: bool
    tmp_fd: int
    lock_fd: int


def supported() -> bool:
    return sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


def send(address: str, pid: int, items: list[Handed], timeout: float = ACK_S) -> bool:
    """Hand ``items`` to the keeper at ``address``; True once it holds them all."""
    if not items:
        return True
    if not supported():
        return False
    head = json.dumps(
        {
            "pid": pid,
            "chunks": [{"tmp": h.tmp, "final": h.final, "durable": h.durable} for h in items],
        }
    ).encode()
    fds = [fd for h in items for fd in (h.tmp_fd, h.lock_fd)]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            s.connect("\0" + address)
            socket.send_fds(s, [head], fds)
            return s.recv(16) == b"ok"
    except OSError as exc:
        log.debug("hand-off to %s failed: %s", address, exc)
        return False


class Keeper:
    """The main process's end (see the module's docstring). One per process."""

    def __init__(self) -> None:
        self.address = f"asynccache-keeper-{os.getpid()}-{secrets.token_hex(6)}"
        self.pid = os.getpid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + self.address)
        self._sock.listen(64)
        forksafe.track_fd(self._sock.fileno())
        self._cv = threading.Condition()
        self._kept = 0  # chunks held now
        self.published = 0  # chunks whose publish this process finished
        self.received = 0  # chunks handed over
        threading.Thread(target=self._serve, name="asynccache-keeper", daemon=True).start()

    # -- receiving ------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._receive(conn)
                except Exception as exc:  # a malformed or cut message: the sender waits itself
                    log.debug("keeper: %s", exc)

    def _receive(self, conn: socket.socket) -> None:
        conn.settimeout(ACK_S)
        # Tracked as they arrive: each carries a flock a child forked now must not keep.
        msg, fds = forksafe.recv_fds(conn, _MAX_MSG, 256, ACK_S)
        try:
            head = json.loads(msg)
            chunks = head["chunks"]
            if len(fds) != 2 * len(chunks):
                raise ValueError(f"{len(fds)} descriptors for {len(chunks)} chunks")
            pid = int(head["pid"])
            _check_sender(conn, pid, chunks)
        except BaseException:
            for fd in fds:
                forksafe.close_fd(fd)
            raise
        with self._cv:
            self._kept += len(chunks)
            self.received += len(chunks)
        for i, c in enumerate(chunks):
            h = Handed(c["tmp"], c["final"], bool(c["durable"]), fds[2 * i], fds[2 * i + 1])
            threading.Thread(
                target=self._keep, args=(h, pid), name="asynccache-keep", daemon=True
            ).start()
        conn.sendall(b"ok")

    # -- keeping --------------------------------------------------------------------
    def _keep(self, h: Handed, pid: int) -> None:
        pidfd: int | None = None
        try:
            pidfd = _pidfd(pid)
            if pidfd is not None:
                forksafe.track_fd(pidfd)
            deadline = time.monotonic() + _keep_s
            while time.monotonic() < deadline:
                if _state(h) != "pending":
                    return  # its worker published it, or its publish failed
                if _dead(pidfd):
                    # The worker is gone mid-publish: finish it (verified before handed).
                    if _state(h) == "pending":
                        _publish(h)
                        with self._cv:
                            self.published += 1
                    return
            log.warning(
                "%s: its worker's publish still running after %gs; left to it", h.final, _keep_s
            )
        except OSError as exc:
            log.warning("%s: finishing a worker's publish failed: %s", h.final, exc)
        finally:
            forksafe.close_fd(h.tmp_fd)
            forksafe.close_fd(h.lock_fd)
            if pidfd is not None:
                with contextlib.suppress(OSError):
                    forksafe.close_fd(pidfd)
            with self._cv:
                self._kept -= 1
                self._cv.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, until nothing is kept; True then."""
        with self._cv:
            return self._cv.wait_for(lambda: self._kept == 0, timeout)


_keep_s = 300.0  # set from Settings.timeout_s by :func:`keeper`
_instance: Keeper | None = None
_mu = threading.Lock()


def keeper(timeout_s: float) -> Keeper | None:
    """This process's keeper, started on first use; None where unsupported."""
    global _instance, _keep_s
    if not supported():
        return None
    with _mu:
        _keep_s = max(_keep_s if _instance is not None else 0.0, timeout_s)
        if _instance is None or _instance.pid != os.getpid():
            _instance = Keeper()
            atexit.register(_instance.wait, timeout_s)
        return _instance


def wait_kept(timeout: float) -> bool:
    """Wait (bounded) for the publishes this process keeps; True when none is left."""
    k = _instance
    return k is None or k.pid != os.getpid() or k.wait(timeout)


def _check_sender(conn: socket.socket, pid: int, chunks: list[dict[str, object]]) -> None:
    """Refuse a message this process must not act on. An abstract socket has no file
    permissions and its name is listed in /proc/net/unix, so any local process can
    connect: the sender must run as this process's user and be the process it names
    (its publishes are what the keeper may finish), and every path must be a temporary
    file of the cache (``.<final>.<pid>.<hex>.tmp``) beside the chunk it becomes."""
    cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    peer, uid, _ = struct.unpack("3i", cred)
    if uid != os.geteuid() or peer != pid:
        raise PermissionError(f"a hand-off from pid {peer} (uid {uid}) naming pid {pid}")
    for c in chunks:
        tmp, final = str(c["tmp"]), str(c["final"])
        name = os.path.basename(tmp)
        if (
            os.path.dirname(tmp) != os.path.dirname(final)
            or not is_chunk_temp_name(name)
            or temp_final_name(name) != os.path.basename(final)
        ):
            raise PermissionError(
                f"a hand-off of {tmp!r} as {final!r}: not a chunk's temporary file"
            )


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return None  # gone already
        raise


def _dead(pidfd: int | None) -> bool:
    if pidfd is None:
        return True
    r, _, _ = select.select([pidfd], [], [], _POLL_S)
    return bool(r)


def _same(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _state(h: Handed) -> str:
    """``published`` (the final name is this file), ``gone`` (neither name is: its
    publish failed and removed it) or ``pending``."""
    if _same(h.final, h.tmp_fd):
        return "published"
    if not _same(h.tmp, h.tmp_fd):
        return "gone"
    return "pending"


def _publish(h: Handed) -> None:
    """:meth:`.TempFile.publish`'s steps on the handed file (verified by its worker)."""
    if h.durable:
        os.fsync(h.tmp_fd)
    fcntl.flock(h.tmp_fd, fcntl.LOCK_SH)
    os.replace(h.tmp, h.final)
    if h.durable:
        fsync_dir(os.path.dirname(h.final))
