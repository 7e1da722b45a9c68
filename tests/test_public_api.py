"""The public surface: ``__all__`` is sorted and is exactly what the package exposes."""

from __future__ import annotations

import types

import asynccache


def test_all_is_sorted_and_complete():
    assert asynccache.__all__ == sorted(asynccache.__all__)
    public = {  # dir(): the torch-facing names are bound on first use
        name
        for name in dir(asynccache)
        if not name.startswith("_") and not isinstance(getattr(asynccache, name), types.ModuleType)
    }
    assert public | {"__version__"} == set(asynccache.__all__)


def test_every_error_derives_from_the_root():
    for name in asynccache.__all__:
        obj = getattr(asynccache, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, asynccache.AsyncCacheError), name


def test_imports_without_the_optional_extras():
    """botocore (s3) and PIL (images) are optional: importing must not need them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('botocore', 'PIL', 'zstandard'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import asynccache\n"
        "from asynccache import Settings\n"
        "from asynccache.storage import open_storage\n"
        "try:\n"
        "    open_storage('s3://bucket/x', Settings())\n"
        "except asynccache.ConfigError as e:\n"
        "    print('config error:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "asynccache[s3]" in out.stdout
