"""The torch-facing layer: the only part of asynccache that imports torch at module level."""
