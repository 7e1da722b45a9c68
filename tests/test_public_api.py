"""The public surface: ``__all__`` is sorted and is exactly what the package exposes."""

from __future__ import annotations

import types

import asynccache


def test_all_is_sorted_and_complete():
    assert asynccache.__all__ == sorted(asynccache.__all__)
    public = {
        name
        for name, value in vars(asynccache).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public | {"__version__"} == set(asynccache.__all__)


def test_every_error_derives_from_the_root():
    for name in asynccache.__all__:
        obj = getattr(asynccache, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, asynccache.AsyncCacheError), name
