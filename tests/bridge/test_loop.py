"""The I/O thread: submit/call, cancellation, timeouts, misuse, fork, clean shutdown."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from asynccache.bridge import LoopThread, get_loop_thread
from asynccache.errors import AsyncCacheError, BridgeError, StorageTimeoutError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def lt():
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.close()


async def _thread_name() -> tuple[str, bool]:
    t = threading.current_thread()
    return t.name, t.daemon


def test_submit_runs_on_named_daemon_thread(lt: LoopThread) -> None:
    assert lt.submit(_thread_name()).result(5) == ("asynccache-io", True)
    assert lt.call(_thread_name(), 5) == ("asynccache-io", True)


def test_one_thread_lazily_started(lt: LoopThread) -> None:
    before = {t.ident for t in threading.enumerate()}
    assert "idle" in repr(lt)
    lt.call(asyncio.sleep(0), 5)
    lt.call(asyncio.sleep(0), 5)
    new = [t for t in threading.enumerate() if t.ident not in before]
    assert [t.name for t in new] == ["asynccache-io"]


def test_cancelling_the_future_cancels_the_coroutine(lt: LoopThread) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fut = lt.submit(forever())
    assert started.wait(5)
    fut.cancel()
    assert cancelled.wait(5)


def test_call_timeout_cancels_and_raises(lt: LoopThread) -> None:
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(StorageTimeoutError) as info:
        lt.call(slow(), 0.2)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, AsyncCacheError)
    assert cancelled.wait(5)


def test_call_from_inside_the_loop_is_an_error(lt: LoopThread) -> None:
    async def nested() -> None:
        lt.call(asyncio.sleep(0), 1)

    with pytest.raises(BridgeError, match="deadlock"):
        lt.call(nested(), 5)


def test_exceptions_reach_the_caller(lt: LoopThread) -> None:
    async def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        lt.call(boom(), 5)


async def test_works_when_the_caller_has_a_running_loop(lt: LoopThread) -> None:
    # As in Jupyter: the calling thread runs a loop of its own.
    assert asyncio.get_running_loop() is not None
    assert lt.call(_thread_name(), 5)[0] == "asynccache-io"


def test_close_runs_closers_and_is_idempotent() -> None:
    lt = LoopThread()
    closed: list[str] = []

    async def closer() -> None:
        closed.append(threading.current_thread().name)

    lt.register_closer(closer)
    unregister = lt.register_closer(closer)
    unregister()

    async def current() -> threading.Thread:
        return threading.current_thread()

    io_thread = lt.call(current(), 5)
    lt.close()
    lt.close()
    assert closed == ["asynccache-io"]
    assert not io_thread.is_alive()
    with pytest.raises(BridgeError):
        lt.submit(asyncio.sleep(0))


def test_get_loop_thread_is_per_process() -> None:
    assert get_loop_thread() is get_loop_thread()


def _child_report(q: mp.Queue, parent_id: int) -> None:  # type: ignore[type-arg]
    lt = get_loop_thread()
    name = lt.call(_thread_name(), 5)[0]
    q.put((os.getpid(), id(lt) != parent_id, name))
    lt.close()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_child_processes_get_their_own_thread(method: str) -> None:
    parent = get_loop_thread()
    parent.call(asyncio.sleep(0), 5)  # the parent's thread is running when we fork
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_child_report, args=(q, id(parent)))
    p.start()
    pid, fresh, name = q.get(timeout=20)
    p.join(10)
    assert p.exitcode == 0
    assert pid != os.getpid() and name == "asynccache-io"
    if method == "fork":
        assert fresh


def _use_parent_instance(q: mp.Queue, lt: LoopThread) -> None:  # type: ignore[type-arg]
    try:
        lt.submit(asyncio.sleep(0))
    except BridgeError as exc:
        q.put(str(exc))
    else:
        q.put("no error")


def test_parent_instance_is_refused_in_a_forked_child() -> None:
    lt = get_loop_thread()
    lt.call(asyncio.sleep(0), 5)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_parent_instance, args=(q, lt))
    p.start()
    assert "parent process" in q.get(timeout=20)
    p.join(10)


def test_sessions_closed_at_exit_without_warnings() -> None:
    script = textwrap.dedent(
        """
        import aiohttp, asyncio, gc
        from asynccache.bridge import get_loop_thread

        lt = get_loop_thread()

        async def make():
            s = aiohttp.ClientSession()
            lt.register_closer(s.close)
            return s

        session = lt.call(make(), 5)
        # no explicit close: the atexit hook must close the session and the loop
        """
    )
    out = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "Unclosed" not in out.stderr and "Warning" not in out.stderr, out.stderr


_REMOTE_EXIT = """
import sys
from asynccache.read.source import DatasetSource

options, url, cache, case = eval(sys.argv[1])
if case == "error after reading":
    # torch is imported in this case only: the other two exit a process without it
    from asynccache.torch.streaming import StreamingDataset
    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    assert ds[0]["name"] == "item-0"
    raise RuntimeError("the user's code failed")
if case == "missing dataset":
    DatasetSource(url + "-missing", cache_dir=cache, storage_options=options)
if case == "missing chunk":
    src = DatasetSource(url, cache_dir=cache, storage_options=options)
    src.downloader().ensure("chunk-9-9.bin", 10).result(30)  # not in the bucket
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["error after reading", "missing dataset", "missing chunk"])
def test_no_unclosed_session_at_exit_after_an_error(tmp_path, objstore, bucket, case) -> None:
    from tests.remote_data import upload_dataset, write_dataset

    src = write_dataset(tmp_path / "src", 8, chunk_size=4)
    url = upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)
    arg = repr((objstore.storage_options, url, str(tmp_path / "cc"), case))
    out = subprocess.run(
        [sys.executable, "-X", "dev", "-c", _REMOTE_EXIT, arg],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr  # the error, and nothing else
    expected = {
        "error after reading": "RuntimeError",
        "missing dataset": "ObjectNotFoundError",
        "missing chunk": "ObjectNotFoundError",
    }[case]
    assert expected in out.stderr, out.stderr
    assert "Unclosed" not in out.stderr and "ResourceWarning" not in out.stderr, out.stderr
