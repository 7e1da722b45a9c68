"""Resume conformance: stopping anywhere and resuming yields exactly the rest.

Every resumable iterable in asynccache (and any user source handed to a
:class:`~asynccache.torch.fetcher.Fetcher`) should pass :func:`assert_resumes_exactly`::

    assert_resumes_exactly(lambda: MyLoader(...), [0, 1, 7, len_minus_one, length])

The check runs through a prefetching ``Fetcher``, so it also proves that the state
taken mid-epoch is the consumer's position, not the background thread's.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asynccache.torch.fetcher import Fetcher

__all__ = ["assert_resumes_exactly", "comparable"]


def comparable(item: Any) -> Any:
    """Turns an item into plain Python values that compare with ``==``.

    Tensors and arrays become ``(dtype, shape, values)``; mappings, lists and
    tuples are converted recursively; anything else is returned as is.
    """
    if isinstance(item, torch.Tensor):
        return ("tensor", str(item.dtype), tuple(item.shape), item.detach().cpu().tolist())
    if isinstance(item, np.ndarray):
        return ("ndarray", str(item.dtype), item.shape, item.tolist())
    if isinstance(item, Mapping):
        return {key: comparable(value) for key, value in item.items()}
    if isinstance(item, (list, tuple)):
        return [comparable(value) for value in item]
    return item


def _first_difference(expected: list[Any], actual: list[Any]) -> str:
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want != got:
            return f"first difference at item {index}: expected {want!r}, got {got!r}"
    return f"lengths differ: expected {len(expected)} items, got {len(actual)}"


def assert_resumes_exactly(
    make_source: Callable[[], Iterable[Any]],
    stop_after_list: Sequence[int],
    *,
    prefetch_batches: int = 2,
    key: Callable[[Any], Any] = comparable,
) -> None:
    """Checks that a source resumes after any stop point with exactly the remaining items.

    The source is iterated once, fully, for the reference. Then, for each ``k`` in
    ``stop_after_list``: a fresh source is iterated through a ``Fetcher`` for ``k``
    items and its ``state_dict()`` is taken (and round-tripped through pickle, as a
    checkpoint would be); a second fresh source and fetcher load that state and
    iterate to the end. The ``k`` items before plus the items after must equal the
    reference, in order.

    Args:
        make_source: Builds a fresh, identically configured iterable that has
            ``state_dict()`` and ``load_state_dict()``.
        stop_after_list: How many items to consume before taking the state; each
            must be between 0 and the reference length.
        prefetch_batches: Prefetch depth of the fetchers, so that the background
            thread runs ahead of the consumer while the state is taken.
        key: Maps each item to a value compared with ``==``.

    Raises:
        AssertionError: Some stop point did not resume exactly.
        ValueError: A stop point is outside the epoch.
    """
    with Fetcher(make_source(), prefetch_batches=prefetch_batches) as fetcher:
        reference = [key(item) for item in fetcher]
    for stop_after in stop_after_list:
        if not 0 <= stop_after <= len(reference):
            raise ValueError(f"stop point {stop_after} is outside 0..{len(reference)}")
        with Fetcher(make_source(), prefetch_batches=prefetch_batches) as fetcher:
            iterator = iter(fetcher)
            before = [key(next(iterator)) for _ in range(stop_after)]
            state = pickle.loads(pickle.dumps(fetcher.state_dict()))
        with Fetcher(make_source(), prefetch_batches=prefetch_batches) as fetcher:
            fetcher.load_state_dict(state)
            after = [key(item) for item in fetcher]
        combined = before + after
        assert combined == reference, (
            f"resuming after {stop_after} items: got {len(before)} + {len(after)} items, "
            f"{_first_difference(reference, combined)}"
        )
