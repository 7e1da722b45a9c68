"""Retry policy: exponential backoff with jitter, capped, honouring Retry-After. Pure.

Two kinds of failure are told apart. A *fault* (a reset, a short body, a 500, a timeout)
counts against ``retries``. A *throttle* (429, 503, ``SlowDown``: the service asks the
client to slow down) does not: a request may be throttled for as long as the service
needs, within a *patience* measured in seconds of backoff (``throttle_patience_s``),
because a storm of throttling lasts seconds to minutes whatever the count of answers.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import Settings

__all__ = ["RetryBudget", "RetryPolicy"]

# The jitter's own source: drawing from the ``random`` module would move the user's seeded
# global state from a background thread (breaking their reproducibility), and a seeded
# instance would give every forked worker the same waits. os.urandom has neither problem.
_JITTER = random.SystemRandom()


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How many times to retry a fault, how long to wait out throttling, and each pause.

    Invariants:
        * ``delay(n)`` lies in ``[0, min(max_s, base_s * 2**(n-1))]`` ("full jitter").
        * A server's ``retry_after`` is honoured by ``delay`` as a lower bound, but never
          beyond ``max_s``.
        * ``should_retry(n)`` is true for ``n <= retries``: ``retries + 1`` attempts in all.
        * ``throttle_delay(n)`` lies in ``[c / 2, c]`` with ``c = min(max_s, base_s *
          2**(n-1))`` ("equal jitter": the waits can't shrink to nothing, so a patience
          bounds the count of throttled attempts too), raised to ``retry_after``.
        * Per request (:class:`RetryBudget`), the throttle waits add up to at most
          ``throttle_patience_s``.
    """

    retries: int = 5
    base_s: float = 0.2
    max_s: float = 10.0
    throttle_patience_s: float = 120.0

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.max_s > 0 and self.throttle_patience_s >= 0):
            raise ConfigError(f"invalid retry policy {self!r}: waits must be positive")

    @classmethod
    def of(cls, settings: Settings) -> RetryPolicy:
        """The policy the settings give (``ASYNCCACHE_RETRIES``, ``BACKOFF_*``,
        ``THROTTLE_PATIENCE_S``)."""
        return cls(
            settings.retries,
            settings.backoff_base_s,
            settings.backoff_max_s,
            settings.throttle_patience_s,
        )

    def should_retry(self, failures: int) -> bool:
        """True when another attempt is allowed after ``failures`` failed attempts."""
        return failures <= self.retries

    def delay(
        self, failures: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before the next attempt, after ``failures`` (>= 1) failures."""
        cap = self._cap(failures)
        wait = (rng or _JITTER).uniform(0.0, cap)
        if retry_after is not None and retry_after > 0:
            wait = max(wait, min(retry_after, self.max_s))
        return wait

    def throttle_delay(
        self, throttles: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait after the ``throttles``-th (>= 1) throttling answer in a row of
        one request: at least half the exponential cap, and at least ``retry_after`` (the
        service's own request, not capped by ``max_s``: the patience bounds it)."""
        cap = self._cap(throttles)
        wait = (rng or _JITTER).uniform(cap / 2, cap)
        if retry_after is not None and retry_after > 0:
            wait = max(wait, retry_after)
        return wait

    def budget(self) -> RetryBudget:
        """The retries of one request, from its first attempt."""
        return RetryBudget(self)

    def max_attempts(self) -> int:
        """The most attempts one request can make: ``retries + 1`` for faults, and the
        throttled ones, whose waits are each at least half their exponential cap."""
        n = 0
        spent = 0.0
        while True:  # the exponential part: at most log2(max_s / base_s) steps
            floor = self._cap(n + 1) / 2
            if floor >= self.max_s / 2 or spent + floor > self.throttle_patience_s:
                break
            spent += floor
            n += 1
        if spent <= self.throttle_patience_s:
            n += math.floor((self.throttle_patience_s - spent) / (self.max_s / 2))
        # The last throttle wait may be a remainder shorter than its floor: one more.
        return self.retries + 1 + n + 1

    def worst_case_s(self, attempt_s: float) -> float:
        """An upper bound on the time one request takes with its retries, when each
        attempt takes at most ``attempt_s``: every attempt, every fault pause (each at
        most ``max_s``) and the whole patience."""
        return (
            self.max_attempts() * attempt_s + self.retries * self.max_s + self.throttle_patience_s
        )

    def _cap(self, n: int) -> float:
        """``min(max_s, base_s * 2**(n-1))``, without overflowing for any ``n``."""
        exp = max(n - 1, 0)
        if exp >= math.log2(self.max_s) - math.log2(self.base_s):
            return self.max_s
        return min(self.max_s, math.ldexp(self.base_s, exp))


@dataclasses.dataclass
class RetryBudget:
    """What one request has spent of its :class:`RetryPolicy`: faults counted, throttling
    answers and the seconds of backoff they cost. One per request, mutated by its caller.

    Invariants:
        * Only faults count against ``policy.retries``; throttling answers never do.
        * ``throttled_s``, the sum of the throttle waits handed out, never exceeds
          ``policy.throttle_patience_s``.
        * A throttle wait is at least the service's ``retry_after``; when the service asks
          for more than the patience left, :meth:`next_delay` gives up instead.
    """

    policy: RetryPolicy
    failures: int = 0
    throttles: int = 0
    throttled_s: float = 0.0

    @property
    def patience_left_s(self) -> float:
        return max(0.0, self.policy.throttle_patience_s - self.throttled_s)

    def next_delay(
        self,
        throttled: bool,
        retry_after: float | None = None,
        rng: random.Random | None = None,
    ) -> float | None:
        """Seconds to wait before the next attempt, after one that failed (``throttled``:
        with a throttling answer); None when the request must give up."""
        if not throttled:
            self.failures += 1
            if not self.policy.should_retry(self.failures):
                return None
            return self.policy.delay(self.failures, retry_after, rng)
        self.throttles += 1
        left = self.patience_left_s
        if left <= 0 or (retry_after is not None and retry_after > left):
            return None
        wait = min(self.policy.throttle_delay(self.throttles, retry_after, rng), left)
        self.throttled_s += wait
        return wait
