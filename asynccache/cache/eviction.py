"""Least-recently-used eviction policy. Pure: no I/O, no clock, no locks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["Entry", "select_victims"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One published chunk as the policy sees it."""

    key: str
    size: int
    last_used: float


def select_victims(
    entries: Iterable[Entry], *, used: int, budget: int, incoming: int = 0
) -> list[Entry]:
    """The entries to remove, oldest use first, so ``used + incoming <= budget``.

    Args:
        entries: evictable entries (the caller leaves pinned ones out).
        used: bytes in the cache now, pinned and temporary files included.
        budget: the byte budget.
        incoming: bytes about to be added.

    Returns:
        The shortest least-recently-used prefix whose removal meets the budget, or every
        entry when even that is not enough (pinned bytes may keep the cache above budget).
        Ties in ``last_used`` break by key, so the result is deterministic.
    """
    excess = used + incoming - budget
    if excess <= 0:
        return []
    victims: list[Entry] = []
    for entry in sorted(entries, key=lambda e: (e.last_used, e.key)):
        if excess <= 0:
            break
        victims.append(entry)
        excess -= entry.size
    return victims
