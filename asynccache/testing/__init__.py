"""Real servers on loopback for tests, demos and benchmarks (no mocks)."""

from .httpserver import RecordedRequest, StaticHTTPServer
from .objstore import ObjectStore, find_weed, free_port

__all__ = ["ObjectStore", "RecordedRequest", "StaticHTTPServer", "find_weed", "free_port"]
