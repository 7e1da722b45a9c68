"""Retry policy: exponential backoff with full jitter, capped, honouring Retry-After. Pure."""

from __future__ import annotations

import dataclasses
import random

__all__ = ["RetryPolicy"]

# The jitter's own source: drawing from the ``random`` module would move the user's seeded
# global state from a background thread (breaking their reproducibility), and a seeded
# instance would give every forked worker the same waits. os.urandom has neither problem.
_JITTER = random.SystemRandom()


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How many times to retry a transient failure, and how long to wait before each.

    Invariants:
        * ``delay(n)`` lies in ``[0, min(max_s, base_s * 2**(n-1))]`` ("full jitter").
        * A server's ``retry_after`` is honoured as a lower bound, but never beyond ``max_s``.
        * ``should_retry(n)`` is true for ``n <= retries``: ``retries + 1`` attempts in all.
    """

    retries: int = 5
    base_s: float = 0.2
    max_s: float = 10.0

    def should_retry(self, failures: int) -> bool:
        """True when another attempt is allowed after ``failures`` failed attempts."""
        return failures <= self.retries

    def delay(
        self, failures: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before the next attempt, after ``failures`` (>= 1) failures."""
        cap = min(self.max_s, self.base_s * (2 ** max(failures - 1, 0)))
        wait = (rng or _JITTER).uniform(0.0, cap)
        if retry_after is not None and retry_after > 0:
            wait = max(wait, min(retry_after, self.max_s))
        return wait
