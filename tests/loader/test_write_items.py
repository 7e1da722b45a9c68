"""Cache.write numbers keys itself; namedtuples and dataclasses come back as themselves."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch

from asynccache import Cache, CacheDataLoader, DataError, SerializationError
from tests.helpers import assert_same
from tests.loader import datasets
from tests.loader.datasets import Point, Sample


def sample(i: int) -> Sample:
    return Sample(torch.full((2, 2), float(i)), i, {"name": f"s{i}"}, Point(i, -i))


def test_write_numbers_keys_in_call_order(tmp_path):
    cache = Cache(tmp_path, chunk_size=2)
    assert [cache.write({"v": np.arange(i)}) for i in range(5)] == [0, 1, 2, 3, 4]
    cache[9] = {"v": np.arange(9)}
    assert cache.write({"v": np.arange(10)}) == 10, "after the highest key written"
    for k in range(5, 9):
        cache[k] = {"v": np.arange(k)}
    cache.done()
    assert len(cache) == 11
    for k in range(11):
        assert np.array_equal(cache[k]["v"], np.arange(k))


def test_namedtuples_and_dataclasses_are_rebuilt_as_themselves(tmp_path):
    cache = Cache(tmp_path)
    for i in range(4):
        cache.write(sample(i))
    cache.write(Point(np.int64(3), [Point(1, 2)]))
    cache.done()
    again = Cache(tmp_path)
    for i in range(4):
        got = again[i]
        assert type(got) is Sample and type(got.where) is Point
        want = sample(i)
        assert_same(dataclasses.asdict(want), dataclasses.asdict(got))
    nested = again[4]
    assert type(nested) is Point and type(nested.y[0]) is Point and nested.y[0] == (1, 2)


def test_namedtuple_items_stream_and_collate(tmp_path):
    cache = Cache(tmp_path, chunk_size=3)
    for i in range(10):
        cache.write(Point(torch.tensor([i]), i))
    cache.done()
    batches = list(CacheDataLoader(str(tmp_path), batch_size=5))
    assert all(type(b) is Point for b in batches)
    assert torch.cat([b.x for b in batches]).flatten().tolist() == list(range(10))


def test_a_class_that_cant_be_rebuilt_is_refused_at_write(tmp_path):
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(SerializationError, match=r"Local.*inside a function"):
        Cache(tmp_path / "a").write(Local(1))

    @dataclasses.dataclass
    class Derived:
        x: int
        y: int = dataclasses.field(init=False, default=0)

    Derived.__module__, Derived.__qualname__ = "tests.loader.datasets", "Derived"
    with pytest.raises(SerializationError, match=r"field 'y' is init=False"):
        Cache(tmp_path / "b").write(Derived(1))
    with pytest.raises(
        SerializationError, match=r"field 'meta' of tests\.loader\.datasets\.Sample"
    ):
        Cache(tmp_path / "c").write(Sample(torch.zeros(1), 1, {"bad": object()}, Point(0, 0)))


def test_reading_a_changed_or_missing_class_names_it(tmp_path, monkeypatch):
    cache = Cache(tmp_path)
    cache.write(sample(1))
    cache.done()

    @dataclasses.dataclass
    class Sample2:
        image: torch.Tensor
        label: int
        where: Point

    monkeypatch.setattr(datasets, "Sample", Sample2)
    with pytest.raises(DataError, match=r"field 'meta' is no longer in the class"):
        Cache(tmp_path)[0]
    monkeypatch.delitem(sys.modules, "tests.loader.datasets")
    with pytest.raises(DataError, match=r"import tests\.loader\.datasets before reading"):
        Cache(tmp_path)[0]
