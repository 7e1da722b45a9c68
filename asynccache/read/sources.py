"""Which source a URL is: a written dataset, a Parquet prefix, or a folder of files.

``StreamingDataset(url, ...)`` asks :func:`open_source`; the rest of the dataset is the
same whatever the answer (docs/sources.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from ..config import Settings
from ..errors import BadIndexError, ConfigError, ObjectNotFoundError
from ..format.parquet import pyarrow_modules
from .listing import NoFilesError
from .parquet import ParquetSource, is_parquet_url
from .source import DatasetSource

__all__ = ["open_source"]


def open_source(
    url: str | os.PathLike[str],
    *,
    columns: Sequence[str] | None = None,
    files: str | None = None,
    decode: Callable[..., Any] | None = None,
    labels: Any = None,
    refresh: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    settings: Settings | None = None,
) -> DatasetSource:
    """The source at ``url``:

    * ``files=`` a glob of other files: a folder of files, one item per file;
    * ``files=`` a glob of ``.parquet`` files, ``columns=`` or a URL ending in
      ``.parquet``: a Parquet source;
    * otherwise (an ``hf://`` repository too) a written dataset (its ``index.json``), or,
      where there is none (or it is another tool's, such as litdata's index of Parquet
      files), the ``.parquet`` files under ``url``.

    Raises:
        ConfigError: options of one kind given for another.
    """
    where = os.fspath(url)
    opts: dict[str, Any] = {
        "cache_dir": cache_dir,
        "storage_options": storage_options,
        "settings": settings,
    }
    if files is not None and not files.endswith(".parquet"):
        if columns is not None:
            raise ConfigError(f"{where}: columns= is for Parquet sources, not files={files!r}")
        from .files import FilesSource

        return FilesSource(
            where, files=files, decode=decode, labels=labels, refresh=refresh, **opts
        )
    if decode is not None or labels is not None:
        raise ConfigError(f"{where}: decode= and labels= go with files= (a folder of files)")
    if files is not None or columns is not None or is_parquet_url(where):
        return ParquetSource(where, columns=columns, files=files, refresh=refresh, **opts)
    try:
        return DatasetSource(where, **opts)
    except (ObjectNotFoundError, BadIndexError) as missing:
        # No index.json of ours (none, or another tool's beside Parquet files).
        if isinstance(missing, BadIndexError) and "not an asynccache index" not in str(missing):
            raise
        try:
            pyarrow_modules()
            return ParquetSource(where, refresh=refresh, **opts)
        except (NoFilesError, ObjectNotFoundError, ConfigError) as exc:
            if isinstance(exc, NoFilesError) or not isinstance(exc, ConfigError):
                raise missing from None  # no Parquet files either: the index's error
            if "pip install" in str(exc):
                raise missing from None  # (pyarrow missing: can't tell; say what is sure)
            raise
