"""Real servers on loopback for tests, demos and benchmarks (no mocks).

Names are imported on first use, so ``python -m asynccache.testing.objstore`` runs its
module without importing it twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .httpserver import RecordedRequest, StaticHTTPServer
    from .objstore import ObjectStore, find_weed, free_port

__all__ = ["ObjectStore", "RecordedRequest", "StaticHTTPServer", "find_weed", "free_port"]

_HOME = {
    "ObjectStore": "objstore",
    "find_weed": "objstore",
    "free_port": "objstore",
    "RecordedRequest": "httpserver",
    "StaticHTTPServer": "httpserver",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
