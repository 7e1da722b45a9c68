"""The retry policy is pure: checked without servers."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from asynccache.download.retry import RetryPolicy


@given(
    failures=st.integers(1, 40),
    base=st.floats(0.001, 5),
    cap=st.floats(0.01, 60),
    seed=st.integers(0, 1000),
)
def test_full_jitter_within_exponential_cap(failures: int, base: float, cap: float, seed: int):
    policy = RetryPolicy(retries=5, base_s=base, max_s=cap)
    d = policy.delay(failures, rng=random.Random(seed))
    assert 0 <= d <= min(cap, base * 2 ** (failures - 1)) + 1e-9


def test_jitter_spreads_delays() -> None:
    policy = RetryPolicy(retries=5, base_s=1.0, max_s=100)
    rng = random.Random(1)
    delays = {round(policy.delay(4, rng=rng), 3) for _ in range(50)}
    assert len(delays) > 40 and max(delays) <= 8.0


def test_retry_after_is_a_floor_but_capped() -> None:
    policy = RetryPolicy(retries=5, base_s=0.01, max_s=3.0)
    assert policy.delay(1, retry_after=2.0) >= 2.0
    assert policy.delay(1, retry_after=100.0) == 3.0


def test_attempt_budget() -> None:
    policy = RetryPolicy(retries=2)
    assert [policy.should_retry(n) for n in (1, 2, 3)] == [True, True, False]
    assert not RetryPolicy(retries=0).should_retry(1)


def test_jitter_leaves_the_global_random_state_alone() -> None:
    """Backoff runs on the I/O thread; it must not move a user's seeded ``random``."""
    random.seed(1234)
    before = random.getstate()
    waits = {RetryPolicy(base_s=1.0, max_s=1.0).delay(3) for _ in range(20)}
    assert random.getstate() == before
    assert len(waits) > 1  # still jittered
