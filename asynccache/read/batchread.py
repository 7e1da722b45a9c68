"""Batch assembly: many items of mapped chunks copied into one buffer, leaf by leaf.

A batch can be assembled without decoding its items one by one when every item of it
has the same *form*: the same tree (dicts with the same keys in the same order, lists
and tuples of the same length) whose leaves have fixed shapes and dtypes:

* numpy arrays and torch tensors of a numeric or bool dtype, stored uncompressed: each
  is a run of bytes at a known offset of the item, copied into row ``j`` of the leaf's
  ``(B, *shape)`` region of the buffer;
* Python ints (64-bit), floats and bools: their values, gathered into an int64 /
  float64 / bool row.

A token block (``TokenBlocks``) is a single array leaf: the block's tokens.

What the buffer holds is exactly what ``torch.utils.data.default_collate`` would build
from the decoded items (the torch layer wraps the regions as tensors): the same dtypes,
shapes and bytes. Anything else (str, bytes, None, images, pickled objects, compressed
buffers, namedtuples, dataclasses, big ints, items of differing forms) is not assembled
here; :func:`chunk_forms` reports such items as having no form, and the caller decodes
and collates them as before.

Forms are learned per chunk, lazily, for the items a batch asks for: an item whose
header bytes equal those of an item already seen shares its form and values (one
vectorised comparison for the items of a chunk of equal-size items); any other item's
header is parsed once.

Memory: given a chunk mapping that carries its open file (``fd``, the reader's
``ChunkMap``), rows of at least ``_LARGE_ROW`` bytes are copied from the file with
``preadv`` straight into the batch buffer (one copy per byte, from the page cache), and the
headers of items that share one are compared by ``pread`` (the few pages mapped to parse
a header are dropped again); the page cache then holds the chunk, not the reading process
(its PSS). Smaller rows are copied through the mapping, vectorised (a system call per
row would cost more than the row).

Layer: above :mod:`asynccache.format`; pure (numpy and msgpack), torch-free.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from ..errors import TruncatedChunkError

__all__ = ["ChunkForms", "Form", "Leaf", "assemble_into", "copy_rows", "layout"]

_U32 = struct.Struct("<I")
ALIGN = 64
_LARGE_ROW = 16 << 10  # rows at least this large are copied one by one, without a temporary
_SCALAR = {"i": np.dtype(np.int64), "f": np.dtype(np.float64), "b": np.dtype(np.bool_)}
_ARRAY_KINDS = frozenset("biufc")
# torch dtype names of tensor leaves this module copies, and their numpy twins (for size).
_TORCH = {
    "bool": "?",
    "uint8": "u1",
    "int8": "i1",
    "int16": "<i2",
    "uint16": "<u2",
    "int32": "<i4",
    "uint32": "<u4",
    "int64": "<i8",
    "uint64": "<u8",
    "float16": "<f2",
    "bfloat16": "<u2",  # 2 bytes; the torch layer views them as bfloat16
    "float32": "<f4",
    "float64": "<f8",
    "complex64": "<c8",
    "complex128": "<c16",
}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a form: ``kind`` ``"a"`` (numpy array), ``"t"`` (torch tensor) or a
    scalar kind ``"i"``/``"f"``/``"b"``; ``dtype`` the numpy dtype string of an array,
    the torch dtype name of a tensor, the row dtype of a scalar; ``shape`` per item."""

    kind: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        if self.kind == "t":
            return np.dtype(_TORCH[self.dtype]).itemsize
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


# A form's tree: ("leaf", index) | ("dict", keys, children) | ("list", children).
Tree = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Form:
    """The shape of an item: its tree and its leaves (in tree order)."""

    tree: Tree
    leaves: tuple[Leaf, ...]

    def regions(self, batch: int) -> tuple[list[int], int]:
        """Byte offsets of each leaf's ``(batch, *shape)`` region and the total size."""
        offsets, pos = [], 0
        for leaf in self.leaves:
            offsets.append(pos)
            pos += -(-leaf.nbytes * batch // ALIGN) * ALIGN
        return offsets, max(pos, ALIGN)


def _walk(node: list[Any], leaves: list[Leaf], where: list[Any]) -> Tree | None:
    """The form tree of ``node``; appends its leaves and, per leaf, where its data is
    (a buffer index for arrays, the value for scalars). None: not assemblable."""
    tag = node[0]
    if tag in _SCALAR:
        leaves.append(Leaf(tag, _SCALAR[tag].str, ()))
        where.append(node[1])
        return ("leaf", len(leaves) - 1)
    if tag == "a":
        dt = np.dtype(node[1])
        if dt.kind not in _ARRAY_KINDS or (not dt.isnative and dt.itemsize > 1):
            return None
        leaves.append(Leaf("a", dt.str, tuple(node[2])))
        where.append(node[3])
        return ("leaf", len(leaves) - 1)
    if tag == "t":
        if node[1] not in _TORCH:
            return None
        leaves.append(Leaf("t", node[1], tuple(node[2])))
        where.append(node[3])
        return ("leaf", len(leaves) - 1)
    if tag == "d":
        keys = []
        for k in node[1]:
            if k[0] not in ("s", "i"):
                return None
            keys.append(k[1])
        children = _walk_all(node[2], leaves, where)
        return None if children is None else ("dict", tuple(keys), children)
    if tag in ("l", "u"):
        children = _walk_all(node[1], leaves, where)
        return None if children is None else ("list", children)
    return None


def _walk_all(nodes: Any, leaves: list[Leaf], where: list[Any]) -> tuple[Any, ...] | None:
    """:func:`_walk` of each node; None as soon as one has no form."""
    out = []
    for v in nodes:
        sub = _walk(v, leaves, where)
        if sub is None:
            return None
        out.append(sub)
    return tuple(out)


def parse(buf: Any, start: int, end: int) -> tuple[Form, list[Any]] | None:
    """The form of the item in ``buf[start:end]`` and, per leaf, its absolute byte
    offset (arrays) or value (scalars); None when the item can't be assembled (or is
    malformed: the per-item path then reports it)."""
    try:
        (hlen,) = _U32.unpack_from(buf, start)
        tree, offsets = msgpack.unpackb(
            buf[start + 4 : start + 4 + hlen], raw=False, use_list=True, strict_map_key=False
        )
    except Exception:
        return None
    leaves: list[Leaf] = []
    where: list[Any] = []
    try:
        form_tree = _walk(tree, leaves, where)
    except Exception:
        return None
    if form_tree is None:
        return None
    for i, leaf in enumerate(leaves):
        if leaf.kind in ("a", "t"):
            try:
                off, n, *codec = offsets[where[i]]
            except (IndexError, TypeError, ValueError):
                return None
            if codec or n != leaf.nbytes or off < 0 or start + off + n > end:
                return None
            where[i] = start + off
    return Form(form_tree, tuple(leaves)), where


class ChunkForms:
    """The forms of one mapped chunk's items, learned as batches ask for them.

    Args:
        buf: the chunk's bytes (a mapping or bytes-like).
        offsets: the item offsets table (``count + 1`` int64 values).
    """

    def __init__(self, buf: Any, offsets: np.ndarray) -> None:
        self.buf = buf
        self.u8 = np.frombuffer(buf, np.uint8)
        self.offsets = offsets
        n = len(offsets) - 1
        # The chunk's open file, when ``buf`` carries one: large rows are read from it.
        self.fd: int | None = getattr(buf, "fd", None)
        self.path: str = getattr(buf, "path", "chunk")
        # Drop the pages read to learn headers, when the rows will come from the file.
        self._drop = (
            self.fd is not None
            and n > 0
            and int(offsets[-1] - offsets[0]) >= _LARGE_ROW * n
            and hasattr(buf, "madvise")
        )
        self.form_id = np.full(n, -2, np.int64)  # -2 not parsed yet, -1 no form
        self.forms: list[Form] = []
        self._index: dict[Form, int] = {}
        # Per form, per leaf, per item: the leaf's absolute byte offset (arrays, int64)
        # or its value (scalars, in the leaf's dtype).
        self.tables: list[list[np.ndarray]] = []
        sizes = np.diff(offsets) if n else np.zeros(0, np.int64)
        # Equal-size items: their headers can be compared as rows of a strided view.
        self._size = int(sizes[0]) if n > 1 and bool(np.all(sizes == sizes[0])) else 0
        self.item_size = self._size  # 0: items of differing sizes
        self._asked = False

    def _learn(self, positions: np.ndarray) -> None:
        todo = positions[self.form_id[positions] == -2]
        if not len(todo):
            return
        todo = np.sort(todo)  # (duplicates are skipped below; np.unique imports numpy.ma)
        # The first batch compares only its own items (it is waited for); later ones
        # sweep the rest of the chunk at once.
        sweep = self._asked
        self._asked = True
        for p in todo.tolist():
            if self.form_id[p] != -2:
                continue
            self._parse_one(p)
            if self._size and self.form_id[p] >= 0:
                # The items not parsed yet whose header is this one's.
                rest = np.flatnonzero(self.form_id == -2) if sweep else todo
                self._copy_same_headers(p, rest)
        if self._drop:
            self.buf.madvise(mmap.MADV_DONTNEED)  # the headers are parsed: unmap their pages

    def _parse_one(self, p: int) -> None:
        a, b = int(self.offsets[p]), int(self.offsets[p + 1])
        got = parse(self.buf, a, b)
        if got is None:
            self.form_id[p] = -1
            return
        form, where = got
        fid = self._index.get(form)
        if fid is None:
            fid = self._index[form] = len(self.forms)
            self.forms.append(form)
            n = len(self.form_id)
            self.tables.append(
                [
                    np.zeros(n, np.int64 if leaf.kind in ("a", "t") else np.dtype(leaf.dtype))
                    for leaf in form.leaves
                ]
            )
        for col, w in zip(self.tables[fid], where, strict=True):
            col[p] = w
        self.form_id[p] = fid

    def _copy_same_headers(self, p: int, todo: np.ndarray) -> None:
        """Items of ``todo`` (not parsed yet) whose header bytes equal item ``p``'s share
        its form and scalar values; their array offsets are ``p``'s shifted by the distance."""
        rest = todo[self.form_id[todo] == -2]
        if not len(rest):
            return
        a = int(self.offsets[p])
        (hlen,) = _U32.unpack_from(self.buf, a)
        width = 4 + hlen  # the length word is compared too: a longer header differs
        base = int(self.offsets[0])
        if self._drop:  # large items: read just the headers (a mapped page each otherwise)
            assert self.fd is not None
            starts = (base + rest * self._size).tolist()
            got = b"".join([os.pread(self.fd, width, o) for o in starts])
            if len(got) != width * len(starts):
                raise TruncatedChunkError(f"{self.path}: the file ends inside an item header")
            rows = np.frombuffer(got, np.uint8).reshape(len(starts), width)
        else:
            rows = np.lib.stride_tricks.as_strided(
                self.u8[base:],
                shape=(len(self.form_id), width),
                strides=(self._size, 1),
                writeable=False,
            )[rest]
        same = rest[np.all(rows == self.u8[a : a + width], axis=1)]
        if not len(same):
            return
        fid = int(self.form_id[p])
        shift = self.offsets[same] - a
        for leaf, col in zip(self.forms[fid].leaves, self.tables[fid], strict=True):
            col[same] = col[p] + shift if leaf.kind in ("a", "t") else col[p]
        self.form_id[same] = fid

    def form_of(self, positions: np.ndarray) -> Form | None:
        """The form all items ``positions`` share; None if any has none or they differ."""
        self._learn(positions)
        ids = self.form_id[positions]
        first = int(ids[0])
        if first < 0 or not np.all(ids == first):
            return None
        return self.forms[first]

    def leaf_data(self, form: Form, positions: np.ndarray, leaf: int) -> np.ndarray:
        """Leaf ``leaf`` of items ``positions``: absolute offsets (int64) or values."""
        for fid, f in enumerate(self.forms):  # (by identity first: a form hashes deeply)
            if f is form:
                return self.tables[fid][leaf][positions]
        return self.tables[self._index[form]][leaf][positions]


def layout(form: Form, batch: int) -> tuple[list[int], int]:
    """Where each leaf's region starts in a buffer for ``batch`` items, and its size."""
    return form.regions(batch)


def assemble_into(
    out: np.ndarray,
    form: Form,
    parts: Sequence[tuple[ChunkForms, np.ndarray, np.ndarray]],
    batch: int,
) -> None:
    """Copy the items of ``parts`` into ``out`` (uint8, at least ``layout(form, batch)``
    bytes): each part is ``(chunk forms, positions in the chunk, rows of the batch)``."""
    regions, _ = form.regions(batch)
    for i, leaf in enumerate(form.leaves):
        start = regions[i]
        if leaf.kind in ("a", "t"):
            n = leaf.nbytes
            if not n:
                continue
            rows = out[start : start + n * batch].reshape(batch, n)
            for cf, pos, sel in parts:
                offs = cf.leaf_data(form, pos, i)
                copy_rows(cf.u8, offs, n, rows, sel, pos, cf.item_size, fd=cf.fd, name=cf.path)
        else:
            dt = np.dtype(leaf.dtype)
            vals = out[start : start + dt.itemsize * batch].view(dt)
            for cf, pos, sel in parts:
                vals[sel] = cf.leaf_data(form, pos, i)


def copy_rows(
    src: np.ndarray,
    offs: np.ndarray,
    n: int,
    rows: np.ndarray,
    sel: np.ndarray,
    pos: np.ndarray,
    stride: int,
    *,
    fd: int | None = None,
    name: str = "chunk",
) -> None:
    """``rows[sel[j]] = src[offs[j] : offs[j] + n]``, one copy per byte.

    With ``fd`` (the file ``src`` maps) rows of at least ``_LARGE_ROW`` bytes are read from
    it by ``preadv``, one call per row: the page cache copies them, and no page of the
    chunk gets mapped into this process (``name``: the file, for errors).

    When the sources are evenly spaced by ``stride`` (item ``pos[j]`` at ``anchor +
    pos[j] * stride``: a chunk of equal-size items, or the blocks of a token chunk) they
    are rows of a strided view of the chunk: a run of items into a run of rows is one
    strided copy; rows that tile the chunk exactly (token blocks) are gathered with one
    ``np.take``; small rows are gathered by fancy indexing (vectorised; the rows pass
    through a temporary). Otherwise, and for large rows, one slice copy per row (numpy's
    ``take`` would first copy a non-contiguous source whole).
    """
    k = len(offs)
    if not k:
        return
    if fd is not None and n >= _LARGE_ROW:
        _pread_rows(fd, offs, n, rows, sel, name)
        return
    r0 = int(sel[0])
    run = int(sel[-1]) - r0 == k - 1 and (k == 1 or bool(np.all(np.diff(sel) == 1)))
    if stride:
        anchor = int(offs[0]) - int(pos[0]) * stride
        if anchor >= 0 and np.array_equal(offs, anchor + pos * stride):
            count = int(pos.max()) + 1
            if anchor + count * stride <= len(src):  # rows of a plain reshape (cheaper)
                view = src[anchor : anchor + count * stride].reshape(count, stride)[:, :n]
            else:
                view = np.lib.stride_tricks.as_strided(
                    src[anchor:], shape=(count, n), strides=(stride, 1), writeable=False
                )
            p0 = int(pos[0])
            if run and int(pos[-1]) - p0 == k - 1 and bool(np.all(np.diff(pos) == 1)):
                rows[r0 : r0 + k] = view[p0 : p0 + k]
                return
            if run and view.flags.c_contiguous:
                np.take(view, pos, axis=0, out=rows[r0 : r0 + k], mode="clip")  # (unbuffered)
                return
            if n < _LARGE_ROW:
                rows[sel] = view[pos]
                return
            for r, p in zip(sel.tolist(), pos.tolist(), strict=True):
                rows[r] = view[p]
            return
    for r, o in zip(sel.tolist(), offs.tolist(), strict=True):
        rows[r] = src[o : o + n]


def _pread_rows(
    fd: int, offs: np.ndarray, n: int, rows: np.ndarray, sel: np.ndarray, name: str
) -> None:
    """``rows[sel[j]] = bytes [offs[j], offs[j] + n)`` of ``fd``, one ``preadv`` a row.

    Raises:
        TruncatedChunkError: the file ``name`` ends inside a row.
    """
    for r, o in zip(sel.tolist(), offs.tolist(), strict=True):
        got = os.preadv(fd, [rows[r]], o)
        if got != n:  # the file is shorter than its offsets table says
            raise TruncatedChunkError(
                f"{name}: the file ends at byte {o + got}, inside an item's {n} bytes at {o}"
            )
