"""Datasets whose index names its chunks otherwise than the writer does."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from asynccache.cache import indexfile
from asynccache.format import INDEX_NAME, Index
from asynccache.format.columns import NAME_RE


def rename_chunks(directory: Path, new_name: Callable[[int], str], *, version: int = 2) -> Index:
    """Rename every chunk of the dataset in ``directory`` to ``new_name(chunk number)``
    (the files too, where the name can be a file here) and write its index again as
    ``version`` 1 or 2. Returns the index written."""
    old = indexfile.read_dir(str(directory))
    entries = []
    for c, e in enumerate(old.chunks):
        name = new_name(c)
        src = directory / e.filename
        if len(name.encode()) <= 255 and "/" not in name and "\0" not in name and name != "..":
            os.replace(src, directory / name)
        entries.append(dataclasses.replace(e, filename=name))
    index = Index(tuple(entries), dict(old.config), old.writer, old.token)
    for f in os.listdir(directory):
        if NAME_RE.match(f):
            os.unlink(directory / f)  # the old sidecar
    if version == 1:
        (directory / INDEX_NAME).write_text(index.to_json())
    else:
        name, data, text = index.to_columns()
        (directory / name).write_bytes(data)
        (directory / INDEX_NAME).write_text(text)
    return index
