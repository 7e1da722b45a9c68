"""Assertions shared by the tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "item") -> None:
    """``a`` and ``b`` are equal values of the same type, dtype and shape (NaN == NaN)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert (
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            if a.numel()
            else True
        ), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert (a != a and b != b) or a == b, f"{path}: {a} != {b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif hasattr(a, "getdata") and hasattr(a, "mode"):  # PIL image
        assert (a.mode, a.size) == (b.mode, b.size), path
        assert np.array_equal(np.asarray(a), np.asarray(b)), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
