"""The LRU policy is pure: checked without files."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from asynccache.cache.eviction import Entry, select_victims


def test_nothing_to_do_under_budget() -> None:
    entries = [Entry("a", 10, 1.0)]
    assert select_victims(entries, used=10, budget=100, incoming=90) == []


def test_oldest_first_and_only_as_many_as_needed() -> None:
    entries = [Entry("new", 10, 3.0), Entry("old", 10, 1.0), Entry("mid", 10, 2.0)]
    victims = select_victims(entries, used=30, budget=30, incoming=15)
    assert [v.key for v in victims] == ["old", "mid"]


def test_ties_break_by_key() -> None:
    entries = [Entry("b", 5, 1.0), Entry("a", 5, 1.0)]
    assert [v.key for v in select_victims(entries, used=10, budget=5)] == ["a"]


def test_everything_when_pinned_bytes_exceed_budget() -> None:
    entries = [Entry("a", 5, 1.0)]
    assert select_victims(entries, used=100, budget=10) == entries


@given(
    st.lists(st.tuples(st.integers(1, 100), st.floats(0, 1e6)), max_size=30),
    st.integers(0, 3000),
    st.integers(0, 200),
    st.integers(0, 500),
)
def test_properties(specs, budget, incoming, pinned) -> None:
    entries = [Entry(f"k{i}", size, t) for i, (size, t) in enumerate(specs)]
    used = sum(e.size for e in entries) + pinned
    victims = select_victims(entries, used=used, budget=budget, incoming=incoming)
    freed = sum(v.size for v in victims)
    # enough was freed, or everything evictable was taken
    assert used + incoming - freed <= budget or len(victims) == len(entries)
    # minimal: without the last victim the budget would not be met
    if victims:
        assert used + incoming - (freed - victims[-1].size) > budget
    # LRU: no kept entry is older than an evicted one
    kept = [e for e in entries if e not in victims]
    if victims and kept:
        assert max((v.last_used, v.key) for v in victims) <= min((k.last_used, k.key) for k in kept)
