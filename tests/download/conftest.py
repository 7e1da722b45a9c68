"""Fixtures shared by the downloader's tests."""

from __future__ import annotations

import pytest

from asynccache.bridge import LoopThread


@pytest.fixture
def lt():
    """An event-loop thread of its own for each test, closed after it."""
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.close()
