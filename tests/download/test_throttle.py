"""Throttling is waited out with a patience in seconds, faults within a count of retries.

The policy is pure (hypothesis properties below); the storms are real: the fault proxy
answers 503 ``SlowDown`` with ``Retry-After`` to every request for a few seconds, in front
of a real HTTP server.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.config import Settings
from asynccache.download.retry import RetryPolicy
from asynccache.errors import (
    ConfigError,
    RetriesExhaustedError,
    ThrottledError,
    ThrottleTimeoutError,
)
from asynccache.read.source import DatasetSource
from asynccache.storage.errmap import status_error
from asynccache.testing.faults import Fault, FaultProxy
from tests.remote_data import write_dataset

pytestmark = pytest.mark.timeout(90)

# One event of a request's life: a throttling answer (True) or a fault (False), with the
# Retry-After the service sent (None: none).
events = st.lists(
    st.tuples(st.booleans(), st.one_of(st.none(), st.floats(0.0, 30.0))), max_size=300
)
policies = st.builds(
    RetryPolicy,
    retries=st.integers(0, 8),
    base_s=st.floats(0.001, 5.0),
    max_s=st.floats(0.01, 20.0),
    throttle_patience_s=st.floats(0.0, 200.0),
)


@given(policy=policies, seq=events, seed=st.integers(0, 2**32))
def test_throttle_waits_never_exceed_the_patience(policy: RetryPolicy, seq, seed: int) -> None:
    rng = random.Random(seed)
    budget = policy.budget()
    waited = 0.0
    for throttled, retry_after in seq:
        wait = budget.next_delay(throttled, retry_after, rng)
        if wait is None:
            break
        assert wait >= 0
        if throttled:
            waited += wait
            assert waited <= policy.throttle_patience_s + 1e-9
            if retry_after is not None:
                assert wait >= retry_after  # honoured, never shortened
    assert budget.throttled_s <= policy.throttle_patience_s + 1e-9


@given(policy=policies, seq=events, seed=st.integers(0, 2**32))
def test_only_faults_count_against_the_retries(policy: RetryPolicy, seq, seed: int) -> None:
    rng = random.Random(seed)
    budget = policy.budget()
    faults = 0
    for throttled, retry_after in seq:
        wait = budget.next_delay(throttled, retry_after, rng)
        if not throttled:
            faults += 1
            # the (retries + 1)-th fault ends the request, however many throttles came
            assert (wait is None) == (faults > policy.retries)
        if wait is None:
            if throttled:  # gave up on throttling: out of patience, or asked for more
                left = policy.throttle_patience_s - (budget.throttled_s)
                assert left <= 0 or (retry_after is not None and retry_after > left)
            break
    assert budget.failures == faults


@given(policy=policies, seed=st.integers(0, 2**32), retry_after=st.floats(0.0, 5.0))
@settings(max_examples=200)
def test_attempts_are_bounded(policy: RetryPolicy, seed: int, retry_after: float) -> None:
    """However the service throttles, one request makes at most ``max_attempts``."""
    rng = random.Random(seed)
    budget = policy.budget()
    attempts = 1
    pattern = [True, True, False, True]
    while True:
        wait = budget.next_delay(pattern[attempts % 4], retry_after if attempts % 3 else None, rng)
        if wait is None:
            break
        attempts += 1
        assert attempts <= policy.max_attempts()


def test_retry_after_beyond_max_s_is_honoured_for_throttling() -> None:
    policy = RetryPolicy(retries=1, base_s=0.01, max_s=0.1, throttle_patience_s=60)
    assert policy.budget().next_delay(True, 7.0) == 7.0  # throttling: the patience bounds it
    assert policy.delay(1, retry_after=7.0) == 0.1  # a fault: capped by max_s, as before


def test_a_retry_after_past_the_patience_gives_up_at_once() -> None:
    budget = RetryPolicy(throttle_patience_s=5.0).budget()
    assert budget.next_delay(True, 3.0) is not None
    assert budget.next_delay(True, 3.0) is None  # 2 s left, asked for 3


def test_throttling_answers_are_throttled_errors() -> None:
    for status in (429, 503):
        assert isinstance(status_error(status, "s3://b/k"), ThrottledError)
    assert not isinstance(status_error(500, "s3://b/k"), ThrottledError)
    with pytest.raises(ConfigError):
        RetryPolicy(base_s=0.0)
    assert issubclass(ThrottleTimeoutError, RetriesExhaustedError)
    assert issubclass(ThrottleTimeoutError, TimeoutError)


# -- storms through the proxy ---------------------------------------------------------------

N_ITEMS, PER_CHUNK = 12, 4


def _settings(tmp_path: Path, **kw) -> Settings:
    base = dict(
        cache_dir=str(tmp_path / "cache"),
        retries=2,  # a count of 2 would end a storm of a dozen answers early
        backoff_base_s=0.05,
        backoff_max_s=0.3,
        throttle_patience_s=30.0,
        timeout_s=5.0,
        progress=False,
    )
    base.update(kw)
    return Settings(**base)


@pytest.fixture
def served(tmp_path, http_origin):
    src = write_dataset(tmp_path / "src", N_ITEMS, chunk_size=PER_CHUNK)
    return src, http_origin(src)


def _read_all(src_dir: Path, source: DatasetSource) -> None:
    for ci in range(source.index.num_chunks):
        path = source.acquire(ci)
        try:
            name = source.index.filename(ci)
            assert Path(path).read_bytes() == (src_dir / name).read_bytes()
        finally:
            source.release(ci)


@pytest.mark.parametrize("receive", ["direct", "aiohttp"])
def test_a_storm_of_slowdown_is_waited_out(served, tmp_path, receive: str) -> None:
    src_dir, server = served
    with FaultProxy(server.url) as proxy:
        # Every GET (index.json, sidecar, chunks) answered 503 SlowDown for 2 s.
        proxy.add_fault(Fault("slowdown", for_s=2.0, retry_after=0.2))
        settings = _settings(tmp_path, receive=receive)
        with DatasetSource(proxy.url, settings=settings) as source:
            _read_all(src_dir, source)
        fired = proxy.fired("slowdown")
        # Far more answers than ASYNCCACHE_RETRIES allows, and the read completed.
        assert fired > settings.retries + 1
        assert proxy.count("GET", "index.json") >= 2
        served_after = [r for r in proxy.requests if r.fault is None and r.method == "GET"]
        assert served_after  # the storm ended and the bytes came


def test_a_storm_longer_than_the_patience_names_the_url_and_the_patience(served, tmp_path) -> None:
    _, server = served
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("slowdown", for_s=600.0, retry_after=0.1))
        settings = _settings(tmp_path, throttle_patience_s=1.0)
        with pytest.raises(ThrottleTimeoutError) as info:
            DatasetSource(proxy.url, settings=settings)
        message = str(info.value)
        assert f"{proxy.url}/index.json" in message
        assert "ASYNCCACHE_THROTTLE_PATIENCE_S" in message and "patience of 1s" in message
        assert "SlowDown" in message
        assert proxy.fired("slowdown") > settings.retries + 1
        assert info.value.url == f"{proxy.url}/index.json"


def test_a_chunk_throttled_past_the_patience_is_a_clear_error(served, tmp_path) -> None:
    _, server = served
    with FaultProxy(server.url) as proxy:
        proxy.add_fault(Fault("slowdown", path="chunk-", for_s=600.0))
        settings = _settings(tmp_path, throttle_patience_s=1.0)
        with DatasetSource(proxy.url, settings=settings) as source:
            name = source.index.filename(0)
            with pytest.raises(ThrottleTimeoutError) as info:
                source.acquire(0)
        message = str(info.value)
        assert f"{proxy.url}/{name}" in message and "patience of 1s" in message
        assert proxy.fired("slowdown") > settings.retries + 1


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"ASYNCCACHE_THROTTLE_PATIENCE_S": "7.5"}, "throttle_patience_s", 7.5),
        ({"ASYNCCACHE_THROTTLE_PATIENCE_S": "0"}, "throttle_patience_s", 0.0),
        ({"ASYNCCACHE_MAX_INDEX_BYTES": "2MiB"}, "max_index_bytes", 2 << 20),
        ({}, "throttle_patience_s", 120.0),
        ({}, "max_index_bytes", 64 << 20),
    ],
)
def test_the_new_settings_from_the_environment(env, field: str, value) -> None:
    assert getattr(Settings.from_env(env), field) == value
    assert RetryPolicy.of(Settings.from_env(env)).throttle_patience_s == (
        Settings.from_env(env).throttle_patience_s
    )


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("ASYNCCACHE_THROTTLE_PATIENCE_S", "-1"),
        ("ASYNCCACHE_THROTTLE_PATIENCE_S", "inf"),
        ("ASYNCCACHE_THROTTLE_PATIENCE_S", "soon"),
        ("ASYNCCACHE_MAX_INDEX_BYTES", "0"),
        ("ASYNCCACHE_MAX_INDEX_BYTES", "lots"),
    ],
)
def test_bad_values_fail_fast_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: raw})
