"""The forms of a mix's whole batches: which rows of a batch of mixed samples each stream
fills, and how.

A batch of a mix is assembled in one buffer only when every sample of it has one form:
token streams of one block size and dtype (each row one slice copy), or item streams
whose chunks' learned forms (:class:`~asynccache.read.batchread.ChunkForms`) agree, read
from mapped chunks (not by range). Otherwise the batch is collated from the items, as a
DataLoader worker would. With ``tag`` the samples are ``(stream, sample)`` pairs: their
form is :func:`tagged`, an int64 leaf ahead of the sample's leaves. On every path row ``i``
is the sample of slot ``i``, and each stream's samples of a batch are read in one pass.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..read.batchread import Form, Leaf, assemble_into
from ..read.token_blocks import copy_blocks
from . import batches
from .streaming import StreamingDataset

__all__ = [
    "copy_token_rows",
    "fill_rows",
    "mixed_items",
    "plan_batch",
    "stream_items",
    "tagged",
    "token_form",
]


@functools.lru_cache(maxsize=64)
def block_form(dtype: str, block_size: int) -> Form:
    """The form of a token block: one array leaf of ``block_size`` tokens."""
    return Form(("leaf", 0), (Leaf("a", dtype, (block_size,)),))


def token_form(streams: Sequence[StreamingDataset]) -> Form | None:
    """The form of every sample when all ``streams`` are token streams of one block size
    and dtype (None: otherwise)."""
    token = [st.unit_reader.blocks for st in streams]
    forms = {None if t is None else (t.dtype.str, t.block_size) for t in token}
    one = forms.pop() if len(forms) == 1 else None
    return block_form(*one) if one else None


@functools.lru_cache(maxsize=64)
def tagged(form: Form) -> Form:
    """The form of ``(stream, sample)`` pairs whose samples have ``form``."""
    return Form(
        ("list", (("leaf", 0), _shifted(form.tree, 1))),
        (Leaf("i", np.dtype(np.int64).str, ()), *form.leaves),
    )


def _shifted(tree: tuple[Any, ...], by: int) -> tuple[Any, ...]:
    """A form tree with its leaf numbers moved up by ``by``."""
    if tree[0] == "leaf":
        return ("leaf", tree[1] + by)
    if tree[0] == "dict":
        return ("dict", tree[1], tuple(_shifted(c, by) for c in tree[2]))
    return ("list", tuple(_shifted(c, by) for c in tree[1]))


def plan_batch(
    streams: Sequence[StreamingDataset], of: np.ndarray, unit_keys: np.ndarray
) -> tuple[Form, list[Any], list[Any]] | None:
    """For the samples ``unit_keys`` of streams ``of`` (one stream index per row): the
    form they share, the item streams' parts for
    :func:`~asynccache.read.batchread.assemble_into` and the token streams' blocks;
    None where they must be collated from the items."""
    form: Form | None = None
    parts: list[tuple[Any, np.ndarray, np.ndarray]] = []
    blocks: list[tuple[Any, Any, np.ndarray, np.ndarray]] = []
    for s, st in enumerate(streams):
        rows = np.flatnonzero(of == s)
        if not len(rows):
            continue
        k = unit_keys[rows]
        ur = st.unit_reader
        tb = ur.blocks
        if tb is not None:
            f = block_form(tb.dtype.str, tb.block_size)
            if form is not None and f != form:
                return None
            form = f
            blocks.append((tb, st.reader, k, rows))
            continue
        chunks, positions, by_range = ur.located(k)
        if by_range:
            return None  # items read by range
        for c in dict.fromkeys(chunks.tolist()):
            sel = np.flatnonzero(chunks == c)
            cf = ur.chunk_forms(c)
            pos = positions[sel]
            got = cf.form_of(pos)
            if got is None or (form is not None and got != form):
                return None
            form = got
            parts.append((cf, pos, rows[sel]))
    if form is None or not batches.supported(form):
        return None
    return form, parts, blocks


def stream_items(st: StreamingDataset, keys: np.ndarray) -> Iterator[Any]:
    """The samples of ``keys`` of stream ``st``, transformed as the stream says."""
    for item in st.unit_reader.read_units(keys)[1]:
        yield st.transform(item) if st.transform else item


def fill_rows(body: np.ndarray, inner: Form, parts: list[Any], blocks: list[Any], n: int) -> None:
    """Fill the ``n`` rows of form ``inner`` in ``body`` from the parts and blocks of
    :func:`plan_batch`."""
    if parts:
        assemble_into(body, inner, parts, n)
    for tb, reader, k, rows in blocks:
        dest = body[: tb.dtype.itemsize * tb.block_size * n].view(tb.dtype)
        tb.assemble_into(reader, k, dest.reshape(n, tb.block_size), at=rows)


def copy_token_rows(
    streams: Sequence[StreamingDataset],
    body: np.ndarray,
    of: np.ndarray,
    unit_keys: np.ndarray,
    chunks: np.ndarray,
    offsets: np.ndarray,
) -> None:
    """Fill ``body`` with token blocks, when every stream is a token stream of one form
    (:func:`token_form`): row ``i`` is block ``unit_keys[i]`` of stream ``of[i]``, at
    ``offsets[i]`` of chunk ``chunks[i]``, each one slice copy, in one pass over the rows
    (:func:`~asynccache.read.token_blocks.copy_blocks`)."""
    n = len(of)
    tb = streams[0].unit_reader.blocks
    assert tb is not None
    rows = body[: tb.dtype.itemsize * tb.block_size * n].view(tb.dtype)
    for st in streams:  # every stream's prefetch starts now, not at its first wait
        st.source.send_hint()
    sources = [(st.unit_reader.blocks, st.reader) for st in streams]
    copy_blocks(
        rows.reshape(n, tb.block_size),
        sources,  # type: ignore[arg-type]
        range(n),
        of.tolist(),
        chunks.tolist(),
        offsets.tolist(),
        unit_keys.tolist(),
    )


def mixed_items(
    streams: Sequence[StreamingDataset], of: np.ndarray, unit_keys: np.ndarray, tag: bool
) -> Iterator[Any]:
    """The samples ``unit_keys`` of streams ``of`` in their order (each stream's read in
    one pass); with ``tag``, ``(stream, sample)`` pairs."""
    per = [stream_items(st, unit_keys[of == s]) for s, st in enumerate(streams)]
    for s in of.tolist():
        item = next(per[s])
        yield (s, item) if tag else item
