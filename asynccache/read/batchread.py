"""Batch assembly: many items of mapped chunks copied into one buffer, leaf by leaf.

A batch can be assembled without decoding its items one by one when every item of it
has the same *form*: the same tree (dicts with the same keys in the same order, lists
and tuples of the same length) whose leaves are:

* numpy arrays and torch tensors of a numeric or bool dtype, stored uncompressed, of
  one shape: each is a run of bytes at a known offset of the item, copied into row
  ``j`` of the leaf's ``(B, *shape)`` region of the buffer;
* Python ints (64-bit), floats and bools, and numeric numpy scalars: their values,
  gathered into an int64 / float64 / bool / the scalar's dtype row;
* with ``objects`` (see :class:`FormCache`), strings and bytes: gathered into a list per
  leaf (:func:`assemble_into` returns them), as ``default_collate`` leaves them.

A token block (``TokenBlocks``) is a single array leaf: the block's tokens.

What the buffer (and the lists) hold is exactly what ``torch.utils.data.default_collate``
would build from the decoded items (the torch layer wraps the regions as tensors): the
same dtypes, shapes and bytes. Anything else (None, images, pickled objects, compressed
buffers, namedtuples, dataclasses, big ints, items of differing forms) is not assembled
here; :meth:`ChunkForms.form_of` reports such items as having no form, and the caller
decodes and collates them as before.

Forms are learned per chunk, for every item of a batch's chunks at once: the item
headers are read in one gather from the mapping (or, for a chunk of large items, one
``preadv`` per item from its file) and decoded with numpy against header
*templates* (:mod:`asynccache.format.headers`: a header with its values cut out), the
templates of a :class:`FormCache` first (learned from earlier chunks of the dataset),
then new ones cut from the first item that none reads. Nothing is done per item in
Python. The first ask of a chunk reads only the batch's own items (it is waited for);
the next reads the rest of the chunk.

Memory: given a chunk mapping that carries its open file (``fd``, the reader's
``ChunkMap``), rows of at least ``_LARGE_ROW`` bytes (and bytes leaves of such chunks)
are copied from the file with ``preadv`` straight into their destination (one copy per
byte, from the page cache), and so are the headers of such a chunk (a page mapped per
header cost more: 2.7 against 1.9 us an item of 100 KiB); the page cache then holds the
chunk, not the reading process (its PSS).
Smaller rows are copied through the mapping, vectorised (a system call per row would
cost more than the row).

Layer: above :mod:`asynccache.format`; pure (numpy and msgpack), torch-free.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import TruncatedChunkError
from ..format import headers
from ..format.headers import Slot, Template

__all__ = [
    "ChunkForms",
    "Form",
    "FormCache",
    "Leaf",
    "assemble_into",
    "bytes_needed",
    "copy_rows",
    "layout",
]

ALIGN = 64
_LARGE_ROW = 16 << 10  # rows at least this large are copied one by one, without a temporary
_SCALAR = {"i": np.dtype(np.int64), "f": np.dtype(np.float64), "b": np.dtype(np.bool_)}
_ARRAY_KINDS = frozenset("biufc")
OBJECT_KINDS = frozenset("sy")  # str / bytes leaves: a list per leaf, not a region
_HEADER_CAP = 16 << 10  # longer headers are not read in bulk (their items: no form)
_FILE_HEADER = 512  # bytes read first from the file for each large item's header
_GATHER_BYTES = 32 << 20  # header bytes gathered at once, at most
_NEW_TEMPLATES = 8  # templates cut per ask; items none of them reads have no form
_KEEP_TEMPLATES = 16  # templates a FormCache keeps (the most recently useful)
_KEEP_BYTES = 32 << 20  # forms a FormCache keeps past their mappings (their tables' bytes)
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
    """One leaf of a form: ``kind`` ``"a"`` (numpy array), ``"t"`` (torch tensor), a
    scalar kind ``"i"``/``"f"``/``"b"``, ``"g"`` (numpy scalar), ``"s"`` (str) or
    ``"y"`` (bytes); ``dtype`` the numpy dtype string of an array or numpy scalar, the
    torch dtype name of a tensor, the row dtype of a scalar, ``""`` for str / bytes;
    ``shape`` per item (``()`` for scalars, str and bytes)."""

    kind: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        if self.kind == "t":
            return np.dtype(_TORCH[self.dtype]).itemsize
        if self.kind in OBJECT_KINDS:
            return 0
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


# A form's tree: ("leaf", index) | ("dict", keys, children) | ("list", children, tag):
# tag "l" a list, "u" a tuple (default_collate makes a list of either; decoding keeps it).
Tree = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Form:
    """The shape of an item: its tree and its leaves (in tree order)."""

    tree: Tree
    leaves: tuple[Leaf, ...]

    def regions(self, batch: int) -> tuple[list[int], int]:
        """Byte offsets of each leaf's ``(batch, *shape)`` region and the total size
        (str and bytes leaves take none)."""
        offsets, pos = [], 0
        for leaf in self.leaves:
            offsets.append(pos)
            pos += -(-leaf.nbytes * batch // ALIGN) * ALIGN
        return offsets, max(pos, ALIGN)

    @property
    def objects(self) -> bool:
        """Some leaf is a str or bytes (collated as a list)."""
        return any(leaf.kind in OBJECT_KINDS for leaf in self.leaves)


# Where a leaf's data is in a template's columns: ("slot", column) for values,
# ("buf", offset column, nbytes column) for buffers.
Source = tuple[Any, ...]


def _shape(v: Any) -> tuple[int, ...] | None:
    """A stored shape, if it is one (a list of non-negative ints)."""
    if not isinstance(v, list) or not all(type(d) is int and d >= 0 for d in v):
        return None
    return tuple(v)


def _walk(
    node: Any, buffers: Any, leaves: list[Leaf], where: list[Source], objects: bool
) -> Tree | None:
    """The form tree of a template's ``node``; appends its leaves and where each leaf's
    data is. None: not assemblable (or not a node :func:`.items.decode` reads as the
    form says: such items are left to it, which reads or reports them)."""
    tag, n = node[0], len(node)
    if tag in _SCALAR and n == 2:
        if not isinstance(node[1], Slot):
            return None
        leaves.append(Leaf(tag, _SCALAR[tag].str, ()))
        where.append(("slot", node[1].index))
        return ("leaf", len(leaves) - 1)
    if tag == "g" and n == 3:
        dt = np.dtype(node[1]) if isinstance(node[1], str) else None
        # (default_collate can't make a tensor of numpy uint64 scalars)
        if dt is None or dt.kind not in _ARRAY_KINDS or not dt.isnative or dt == np.uint64:
            return None
        if not isinstance(node[2], Slot) or node[2].width != dt.itemsize:
            return None
        leaves.append(Leaf("g", dt.str, ()))
        where.append(("slot", node[2].index))
        return ("leaf", len(leaves) - 1)
    if (tag in ("a", "t") and n == 4) or (tag == "y" and n == 2):
        if tag == "y":
            if not objects:
                return None
            leaf = Leaf("y", "", ())
        else:
            shape = _shape(node[2])
            if shape is None or not isinstance(node[1], str):
                return None
            if tag == "a":
                dt = np.dtype(node[1])
                if dt.kind not in _ARRAY_KINDS or (not dt.isnative and dt.itemsize > 1):
                    return None
                leaf = Leaf("a", dt.str, shape)
            elif node[1] in _TORCH:
                leaf = Leaf("t", node[1], shape)
            else:
                return None
        idx = node[-1]
        if type(idx) is not int or not 0 <= idx < len(buffers):
            return None
        entry = buffers[idx]
        if len(entry) != 2:  # compressed: the leaf is decoded, not copied
            return None
        leaves.append(leaf)
        where.append(("buf", entry[0].index, entry[1].index))
        return ("leaf", len(leaves) - 1)
    if tag == "s" and n == 2:
        if not objects or not isinstance(node[1], Slot):
            return None
        leaves.append(Leaf("s", "", ()))
        where.append(("slot", node[1].index))
        return ("leaf", len(leaves) - 1)
    if tag == "d" and n == 3:
        if not isinstance(node[1], list) or len(node[1]) != len(node[2]):
            return None
        keys = []
        for k in node[1]:  # (keys decode as themselves only with their own type)
            if len(k) != 2 or (k[0], type(k[1])) not in (("s", str), ("i", int)):
                return None
            keys.append(k[1])
        children = _walk_all(node[2], buffers, leaves, where, objects)
        return None if children is None else ("dict", tuple(keys), children)
    if tag in ("l", "u") and n == 2:
        children = _walk_all(node[1], buffers, leaves, where, objects)
        return None if children is None else ("list", children, tag)
    return None


def _walk_all(
    nodes: Any, buffers: Any, leaves: list[Leaf], where: list[Source], objects: bool
) -> tuple[Any, ...] | None:
    """:func:`_walk` of each node; None as soon as one has no form."""
    out = []
    for v in nodes:
        sub = _walk(v, buffers, leaves, where, objects)
        if sub is None:
            return None
        out.append(sub)
    return tuple(out)


class _Known:
    """A header template and the form of the items it reads (None: no form)."""

    __slots__ = ("form", "template", "where")

    def __init__(self, template: Template, objects: bool) -> None:
        self.template = template
        leaves: list[Leaf] = []
        where: list[Source] = []
        form = None
        try:  # (a corrupt header can hold anything: no form, decode reports it)
            tree = _walk(template.tree, template.buffers, leaves, where, objects)
            if tree is not None:
                form = Form(tree, tuple(leaves))
                hash(form)
        except Exception:
            form = None
        self.form = form
        self.where = where


class FormCache:
    """The forms of one dataset's mapped chunks (at most ``max_chunks`` held with their
    mappings, least recently used first out), and the header templates learned from
    them, for every later chunk.

    Args:
        max_chunks: chunks whose forms are kept with their mapping.
        objects: str and bytes leaves are part of a form (the caller carries the lists
            :func:`assemble_into` returns to the consumer); else their items have none.

    Invariant: a chunk's forms are used only with a mapping of the file they were learned
    from (the same device, inode, modification time and size: a chunk published again is
    another file). Forms let go with their mapping (:meth:`clear`, or past
    ``max_chunks``) are kept without it, up to ``_KEEP_BYTES`` of tables, and taken up
    again by the next mapping of the same file (the next epoch reads no header again).
    Templates hold no mapping and survive :meth:`clear` and pickling (a DataLoader worker
    starts with those its parent learned); forms are not pickled.
    """

    def __init__(self, max_chunks: int, *, objects: bool = False) -> None:
        self.max_chunks, self.objects = max_chunks, objects
        self.known: list[_Known] = []
        self._chunks: collections.OrderedDict[int, ChunkForms] = collections.OrderedDict()
        self._kept: collections.OrderedDict[int, ChunkForms] = collections.OrderedDict()

    def get(self, chunk: int, buf: Any, offsets: np.ndarray) -> ChunkForms:
        """The forms of ``chunk``, mapped as ``buf`` with item offsets ``offsets``."""
        cf = self._chunks.get(chunk)
        if cf is None or cf.buf is not buf:
            kept = cf.detached() if cf is not None else self._kept.pop(chunk, None)
            if kept is not None and kept.attach(buf, offsets):
                cf = kept
            else:
                cf = ChunkForms(buf, offsets, cache=self)
            self._chunks[chunk] = cf
            while len(self._chunks) > self.max_chunks:
                self._keep(*self._chunks.popitem(last=False))
        self._chunks.move_to_end(chunk)
        return cf

    def __len__(self) -> int:
        """Chunks whose forms are held with their mapping."""
        return len(self._chunks)

    def clear(self) -> None:
        """Let go of every chunk's mapping (their forms are kept without it); keep the
        templates."""
        while self._chunks:
            self._keep(*self._chunks.popitem(last=False))

    def _keep(self, chunk: int, cf: ChunkForms) -> None:
        kept = cf.detached()  # (cf itself may still be in use, with its mapping)
        if kept is not None:
            self._kept[chunk] = kept
            self._kept.move_to_end(chunk)
        held = sum(x.nbytes for x in self._kept.values())
        while self._kept and held > _KEEP_BYTES:
            held -= self._kept.popitem(last=False)[1].nbytes

    def _used(self, known: _Known) -> None:
        """``known`` read some items: first in line for the next chunk."""
        if self.known and self.known[0] is known:
            return
        if known in self.known:
            self.known.remove(known)
        self.known.insert(0, known)
        del self.known[_KEEP_TEMPLATES:]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chunks"] = collections.OrderedDict()  # a process's own mappings
        state["_kept"] = collections.OrderedDict()  # (tables of every chunk: not shipped)
        return state


class ChunkForms:
    """The forms of one mapped chunk's items, learned as batches ask for them.

    Args:
        buf: the chunk's bytes (a mapping or bytes-like).
        offsets: the item offsets table (``count + 1`` int64 values).
        cache: the dataset's :class:`FormCache` (templates shared with its other
            chunks, and whether str / bytes leaves have a form); None: a private one.
    """

    def __init__(self, buf: Any, offsets: np.ndarray, cache: FormCache | None = None) -> None:
        self.offsets = np.asarray(offsets, np.int64)
        n = len(offsets) - 1
        self.cache = cache if cache is not None else FormCache(1)
        self._bind(buf)
        self.file = self._file()  # (None: not kept past its mapping)
        self.form_id = np.full(n, -2, np.int64)  # -2 not read yet, -1 no form
        self.forms: list[Form] = []
        self._index: dict[Form, int] = {}
        # Per form, per leaf, per item: the leaf's absolute byte offset (arrays, int64),
        # its value (scalars, in the leaf's dtype), or its absolute start and length in
        # bytes (str / bytes, an (n, 2) int64).
        self.tables: list[list[np.ndarray]] = []
        sizes = np.diff(self.offsets) if n else np.zeros(0, np.int64)
        # Equal-size items: their rows are rows of a strided view of the chunk.
        self.item_size = int(sizes[0]) if n > 1 and bool(np.all(sizes == sizes[0])) else 0
        self._asked = False

    def _bind(self, buf: Any) -> None:
        self.buf = buf
        self.u8 = np.frombuffer(buf, np.uint8)
        n = len(self.offsets) - 1
        # The chunk's open file, when ``buf`` carries one: large rows are read from it.
        self.fd: int | None = getattr(buf, "fd", None)
        self.path: str = getattr(buf, "path", "chunk")
        # Large items: their rows, headers and bytes come from the file, not the mapping.
        self._drop = (
            self.fd is not None
            and n > 0
            and int(self.offsets[-1] - self.offsets[0]) >= _LARGE_ROW * n
            and hasattr(buf, "madvise")
        )

    def _file(self) -> tuple[int, ...] | None:
        """What identifies the file mapped: device, inode, modification time, size."""
        if self.fd is None:
            return None
        try:
            st = os.fstat(self.fd)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the forms' tables."""
        return self.form_id.nbytes + sum(t.nbytes for ts in self.tables for t in ts)

    def detached(self) -> ChunkForms | None:
        """The forms learned, without the mapping (a new object sharing the tables; this
        one is unchanged); None when they can't be kept (no file to know the chunk by)."""
        if self.file is None:
            return None
        out = object.__new__(ChunkForms)
        out.__dict__.update(self.__dict__)
        out.buf, out.u8, out.fd = None, np.zeros(0, np.uint8), None
        return out

    def attach(self, buf: Any, offsets: np.ndarray) -> bool:
        """Take up ``buf``, a new mapping of this chunk, keeping the forms learned; False
        (nothing changed) when it maps another file or another offsets table."""
        fd = getattr(buf, "fd", None)
        try:
            st = os.fstat(fd) if fd is not None else None
        except OSError:
            st = None
        if st is None or self.file != (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size):
            return False
        if not np.array_equal(np.asarray(offsets, np.int64), self.offsets):
            return False
        self._bind(buf)
        return True

    def _learn(self, positions: np.ndarray, ahead: np.ndarray | None = None) -> None:
        if not len(positions) or bool(np.all(self.form_id[positions] != -2)):
            return
        if not self._asked:  # the first ask: the batch's own (it is waited for)
            todo = self._unread(positions)
        elif ahead is None:  # later ones: every item not read yet, at once
            todo = np.flatnonzero(self.form_id == -2)
        else:  # ... or those the caller reads next
            todo = self._unread(np.concatenate((positions, ahead)))
        self._asked = True
        starts, ends = self.offsets[todo], self.offsets[todo + 1]
        if self._drop:  # large items: from the file (a page mapped per header costs more)
            rows, lens = self._file_headers(starts, ends)
            self.form_id[todo[lens < 0]] = -1
            self._read(todo, rows, lens)
            return
        lens = headers.lengths(self.u8, starts, ends, _HEADER_CAP)
        self.form_id[todo[lens < 0]] = -1
        block = max(1, _GATHER_BYTES // (int(lens.max(initial=0)) + 16))
        for a in range(0, len(todo), block):
            rows = headers.gather(self.u8, starts[a : a + block], lens[a : a + block])
            if not self._read(todo[a : a + block], rows, lens[a : a + block]):
                return

    def _unread(self, positions: np.ndarray) -> np.ndarray:
        """Positions among ``positions`` whose header is not read yet, sorted, once each."""
        todo = np.sort(positions[self.form_id[positions] == -2])
        if len(todo) > 1:  # (np.unique imports numpy.ma)
            todo = todo[np.concatenate(([True], todo[1:] != todo[:-1]))]
        return todo

    def _file_headers(self, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The headers of items ``[starts, ends)`` read from the chunk's file, a ``preadv``
        each into a row of one matrix (a longer header: once more, whole), as
        :func:`asynccache.format.headers.gather` and ``lengths`` return them.

        Raises:
            TruncatedChunkError: the file ends inside an item's header.
        """
        assert self.fd is not None
        m = len(starts)
        first = _FILE_HEADER  # the length word and most headers
        rows = np.zeros((m, first + headers.TAKE), np.uint8)
        for j, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            want = min(first, b - a)
            if os.preadv(self.fd, [rows[j, :want].data], a) != want:
                raise TruncatedChunkError(f"{self.path}: the file ends inside an item header")
        sizes = ends - starts
        hlen = np.ascontiguousarray(rows[:, :4]).view("<u4").reshape(m).astype(np.int64)
        lens = np.where((sizes >= 4) & (hlen + 4 <= sizes) & (hlen <= _HEADER_CAP), hlen, -1)
        longer = np.flatnonzero(lens + 4 > first)
        if len(longer):  # rare: headers past the first read, each read whole
            wide = np.zeros((m, int(lens.max()) + 4 + headers.TAKE), np.uint8)
            wide[:, : rows.shape[1]] = rows
            for j in longer.tolist():
                a, n = int(starts[j]), int(lens[j]) + 4
                if os.preadv(self.fd, [wide[j, :n].data], a) != n:
                    raise TruncatedChunkError(f"{self.path}: the file ends inside an item header")
            rows = wide
        return rows[:, 4:], lens

    def _read(self, todo: np.ndarray, rows: np.ndarray, lens: np.ndarray) -> bool:
        """Assign a form (or none) to items ``todo``, whose headers are ``rows``. False
        when the chunk turned out to be one of many shapes: ``_NEW_TEMPLATES`` new
        templates left some of them unread, and every item of the chunk not read yet gets
        none (collated; its header is never read here)."""
        left = np.flatnonzero(lens >= 0)
        for known in list(self.cache.known):
            if not len(left):
                return True
            left = self._apply(known, todo, rows, lens, left)
        new = 0
        while len(left):
            if new == _NEW_TEMPLATES:  # a chunk of many shapes: the rest are collated
                self.form_id[self.form_id == -2] = -1  # (todo[left] among them)
                return False
            j = int(left[0])
            tpl = headers.compile_header(rows[j, : lens[j]].tobytes())
            if tpl is None:
                self.form_id[todo[j]] = -1
                left = left[1:]
                continue
            new += 1
            known = _Known(tpl, self.cache.objects)
            after = self._apply(known, todo, rows, lens, left)
            if len(after) and after[0] == j:  # its own header unread: not one it can cut
                self.form_id[todo[j]] = -1
                after = after[1:]
            left = after
        return True

    def _apply(
        self, known: _Known, todo: np.ndarray, rows: np.ndarray, lens: np.ndarray, left: np.ndarray
    ) -> np.ndarray:
        """Items ``todo[left]`` that ``known``'s template reads get its form (or none, or
        none when a buffer lies outside the item); returns the others."""
        sub = rows if len(left) == len(rows) else rows[left]
        ok, cols = headers.match(known.template, sub, lens[left])
        hit = np.flatnonzero(ok)
        if not len(hit):
            return left
        if len(hit) > 1 or known in self.cache.known:
            # (A new template that read one header alone is not kept for other chunks:
            # ragged arrays, each of its own shape, would fill the list with templates
            # that every later chunk tries in vain.)
            self.cache._used(known)
        p = todo[left[hit]]
        form = known.form
        if form is None:
            self.form_id[p] = -1
            return left[~ok]
        fid = self._fid(form)
        start = self.offsets[p]
        size = self.offsets[p + 1] - start
        good = np.ones(len(p), bool)
        for leaf, src, table in zip(form.leaves, known.where, self.tables[fid], strict=True):
            if src[0] == "buf":
                off, n = cols[src[1]][hit], cols[src[2]][hit]
                good &= (off >= 0) & (n >= 0) & (off + n <= size)
                if leaf.kind == "y":
                    table[p, 0], table[p, 1] = start + off, n
                else:
                    good &= n == leaf.nbytes
                    table[p] = start + off
                continue
            col = cols[src[1]][hit]
            if leaf.kind == "s":  # (start in the header, after its length word)
                table[p, 0], table[p, 1] = start + 4 + col[:, 0], col[:, 1]
                good &= _utf8_rows(sub, hit, col)  # (else decode refuses the item)
            elif leaf.kind == "g":
                table[p] = np.ascontiguousarray(col).view(table.dtype).reshape(len(p))
            else:
                table[p] = col
        self.form_id[p[good]] = fid
        self.form_id[p[~good]] = -1  # (the per-item path reports them)
        return left[~ok]

    def _fid(self, form: Form) -> int:
        fid = self._index.get(form)
        if fid is None:
            fid = self._index[form] = len(self.forms)
            self.forms.append(form)
            n = len(self.form_id)
            self.tables.append(
                [
                    np.zeros((n, 2), np.int64)
                    if leaf.kind in OBJECT_KINDS
                    else np.zeros(n, np.int64 if leaf.kind in ("a", "t") else np.dtype(leaf.dtype))
                    for leaf in form.leaves
                ]
            )
        return fid

    def form_of(self, positions: np.ndarray, ahead: np.ndarray | None = None) -> Form | None:
        """The form all items ``positions`` share; None if any has none or they differ.

        The first ask reads the headers of ``positions`` only; each later one that finds
        one not read also reads those of ``ahead``, the items of this chunk the caller
        reads next (default: every item not read yet; a reader of a shuffled window
        shared with other processes reads about ``1 / readers`` of each chunk)."""
        self._learn(positions, ahead)
        ids = self.form_id[positions]
        first = int(ids[0])
        if first < 0 or not np.all(ids == first):
            return None
        return self.forms[first]

    def leaf_data(self, form: Form, positions: np.ndarray, leaf: int) -> np.ndarray:
        """Leaf ``leaf`` of items ``positions``: absolute offsets (int64), values, or
        (start, length) pairs (str / bytes)."""
        for fid, f in enumerate(self.forms):  # (by identity first: a form hashes deeply)
            if f is form:
                return self.tables[fid][leaf][positions]
        return self.tables[self._index[form]][leaf][positions]

    def objects(self, form: Form, positions: np.ndarray, leaf: int) -> list[Any]:
        """The str or bytes values of leaf ``leaf`` of items ``positions``, as a list.

        Raises:
            TruncatedChunkError: the chunk's file ends inside a bytes value.
        """
        spans = self.leaf_data(form, positions, leaf)
        if form.leaves[leaf].kind == "s":
            return _strings(self.u8, spans)
        return [self._bytes_at(o, n) for o, n in spans.tolist()]

    def _bytes_at(self, o: int, n: int) -> bytes:
        """The ``n`` bytes at offset ``o`` of the chunk, a copy.

        Raises:
            TruncatedChunkError: the chunk's file ends inside them.
        """
        if self._drop:  # large items: from the file, no page of the chunk mapped here
            assert self.fd is not None
            out = os.pread(self.fd, n, o)
            if len(out) != n:
                raise TruncatedChunkError(f"{self.path}: the file ends inside an item's bytes")
            return out
        buf = self.buf
        if isinstance(buf, (bytes, mmap.mmap)):
            return buf[o : o + n]
        return self.u8[o : o + n].tobytes()

    def copy_bytes(
        self,
        form: Form,
        positions: np.ndarray,
        leaf: int,
        out: np.ndarray,
        at: int,
        spans: np.ndarray,
        sel: np.ndarray,
    ) -> int:
        """The bytes values of leaf ``leaf`` of items ``positions``, copied back to back
        into ``out`` from byte ``at``; ``spans[sel[j]]`` = (start, length) of item j's.
        Returns where the next value goes.

        Raises:
            TruncatedChunkError: the chunk's file ends inside a value.
        """
        src = self.leaf_data(form, positions, leaf)
        for r, (o, n) in zip(sel.tolist(), src.tolist(), strict=True):
            if self._drop:  # large items: from the file, no page of the chunk mapped here
                assert self.fd is not None
                if n and os.preadv(self.fd, [out[at : at + n].data], o) != n:
                    raise TruncatedChunkError(f"{self.path}: the file ends inside an item's bytes")
            else:
                out[at : at + n] = self.u8[o : o + n]
            spans[r, 0], spans[r, 1] = at, n
            at += n
        return at

    def items(self, positions: np.ndarray) -> Iterator[Any] | None:
        """Items ``positions``, in that order, as :func:`asynccache.format.items.decode`
        returns them one by one (arrays are read-only views of the chunk), built from the
        forms' tables with no header parsed per item; None unless they share a form of no
        tensor leaf (the caller decodes them one by one).

        The tables are read for all of them at once; each item is made as the iterator
        reaches it, its bytes values copied then: items asked for together are not all
        held at once (fresh heap pages for each group of copies cost more than the
        copying).
        """
        form = self.form_of(positions)
        if form is None or any(leaf.kind == "t" for leaf in form.leaves):
            return None
        cols: list[list[Any]] = []
        lazy: list[int] = []  # bytes leaves: (offset, length) per item, copied when made
        for i, leaf in enumerate(form.leaves):
            if leaf.kind == "y":
                cols.append(self.leaf_data(form, positions, i).tolist())
                lazy.append(i)
                continue
            if leaf.kind in OBJECT_KINDS:
                cols.append(self.objects(form, positions, i))
                continue
            data = self.leaf_data(form, positions, i)
            if leaf.kind == "a":
                dt, shape, n, u8 = np.dtype(leaf.dtype), leaf.shape, leaf.nbytes, self.u8
                if len(shape) == 1:
                    cols.append([u8[o : o + n].view(dt) for o in data.tolist()])
                else:
                    cols.append([u8[o : o + n].view(dt).reshape(shape) for o in data.tolist()])
            elif leaf.kind == "g":
                cols.append(list(data))  # numpy scalars
            else:
                cols.append(data.tolist())  # int / float / bool
        return self._made(form.tree, cols, lazy)

    def _made(self, tree: Tree, cols: list[list[Any]], lazy: list[int]) -> Iterator[Any]:
        """The items of columns ``cols`` one by one, as :meth:`items` describes."""
        plain = tree[0] == "dict" and all(c[0] == "leaf" for c in tree[2])
        if plain:
            keys, order = tree[1], [c[1] for c in tree[2]]
            if order != list(range(len(order))):
                lazy = [order.index(k) for k in lazy]
                cols = [cols[k] for k in order]
        for row in zip(*cols, strict=True):
            if lazy:
                values = list(row)
                for k in lazy:
                    values[k] = self._bytes_at(*values[k])
                row = tuple(values)
            if tree[0] == "leaf":
                yield row[0]
            elif plain:
                yield dict(zip(keys, row, strict=True))
            else:
                yield _make(tree, row)


def _make(node: Tree, row: tuple[Any, ...]) -> Any:
    """One item of form tree ``node`` from its leaves' values ``row``."""
    if node[0] == "leaf":
        return row[node[1]]
    if node[0] == "dict":
        return {k: _make(c, row) for k, c in zip(node[1], node[2], strict=True)}
    values = [_make(c, row) for c in node[1]]
    return tuple(values) if node[2] == "u" else values


def _joined(u8: np.ndarray, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bytes at ``spans`` (absolute start, length) of ``u8``, gathered back to back,
    and the NUL-joined run of them (a NUL between two)."""
    starts, lens = spans[:, 0], spans[:, 1]
    k, total = len(lens), int(lens.sum())
    ends = np.cumsum(lens)
    # Byte j of the run: string r's byte (j - its first), where r is the one j falls in.
    raw = u8[np.repeat(starts - (ends - lens), lens) + np.arange(total)]
    joined = np.zeros(total + max(k - 1, 0), np.uint8)
    joined[np.arange(total) + np.repeat(np.arange(k), lens)] = raw
    return raw, joined


def _utf8(u8: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Which of the strings at ``spans`` of ``u8`` are valid UTF-8 (decode refuses the
    others: their items are left to it). One decode of all of them, unless one fails."""
    ok = np.ones(len(spans), bool)
    if not len(spans):
        return ok
    try:  # (a NUL ends any multi-byte sequence: valid joined iff each is valid)
        _joined(u8, spans)[1].tobytes().decode("utf-8")
        return ok
    except UnicodeDecodeError:
        pass
    for j, (a, n) in enumerate(spans.tolist()):
        try:
            u8[a : a + n].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            ok[j] = False
    return ok


def _utf8_rows(rows: np.ndarray, hit: np.ndarray, col: np.ndarray) -> np.ndarray:
    """:func:`_utf8` of strings read with the headers (``rows``, each string at
    ``col[j]`` = (start in its row, length) of row ``hit[j]``)."""
    flat = np.ascontiguousarray(rows[hit]).reshape(-1)
    width = rows.shape[1]
    spans = np.stack([np.arange(len(hit)) * width + col[:, 0], col[:, 1]], axis=1)
    return _utf8(flat, spans)


def _strings(u8: np.ndarray, spans: np.ndarray) -> list[str]:
    """The UTF-8 strings at ``spans`` (absolute start, length) of ``u8``: one gather and
    one decode for all of them (joined by NUL, split again), unless one holds a NUL."""
    if not int(spans[:, 1].sum()):
        return [""] * len(spans)
    raw, joined = _joined(u8, spans)
    if not raw.all():  # a NUL inside a string: split would cut it
        pairs = spans.tolist()
        return [u8[a : a + n].tobytes().decode("utf-8") for a, n in pairs]
    return joined.tobytes().decode("utf-8").split("\0")


def layout(form: Form, batch: int) -> tuple[list[int], int]:
    """Where each leaf's region starts in a buffer for ``batch`` items, and its size."""
    return form.regions(batch)


def assemble_into(
    out: np.ndarray,
    form: Form,
    parts: Sequence[tuple[ChunkForms, np.ndarray, np.ndarray]],
    batch: int,
) -> list[list[Any]] | None:
    """Copy the items of ``parts`` into ``out`` (uint8, at least ``layout(form, batch)``
    bytes): each part is ``(chunk forms, positions in the chunk, rows of the batch)``.

    Returns the values of the form's str / bytes leaves, one entry per such leaf in leaf
    order (for ``batches.wrap``): a list of ``batch`` values, or, for bytes leaves when
    ``out`` has :func:`bytes_needed` more bytes past the layout, a ``(batch, 2)`` int64
    array of where each value was copied in ``out`` (start, length): the consumer makes
    the ``bytes`` from the buffer it maps, and they never pass through a pipe. None when
    the form has no str / bytes leaf.
    """
    regions, end = form.regions(batch)
    objects: list[Any] | None = None
    tail = None
    if any(leaf.kind == "y" for leaf in form.leaves) and len(out) - end >= bytes_needed(
        form, parts
    ):
        tail = end
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
        elif leaf.kind in OBJECT_KINDS:
            if objects is None:
                objects = []
            if leaf.kind == "y" and tail is not None:
                spans = np.empty((batch, 2), np.int64)
                for cf, pos, sel in parts:
                    tail = cf.copy_bytes(form, pos, i, out, tail, spans, sel)
                objects.append(spans)
                continue
            if len(parts) == 1 and np.array_equal(parts[0][2], np.arange(batch)):
                objects.append(parts[0][0].objects(form, parts[0][1], i))
                continue
            vals = np.empty(batch, object)
            for cf, pos, sel in parts:
                got = np.empty(len(pos), object)
                got[:] = cf.objects(form, pos, i)
                vals[sel] = got
            objects.append(vals.tolist())
        else:
            dt = np.dtype(leaf.dtype)
            vals = out[start : start + dt.itemsize * batch].view(dt)
            for cf, pos, sel in parts:
                vals[sel] = cf.leaf_data(form, pos, i)
    return objects


def bytes_needed(form: Form, parts: Sequence[tuple[ChunkForms, np.ndarray, np.ndarray]]) -> int:
    """Bytes of the values of ``form``'s bytes leaves in the items of ``parts``: what a
    buffer needs past ``layout(form, batch)`` for :func:`assemble_into` to copy them in."""
    total = 0
    for i, leaf in enumerate(form.leaves):
        if leaf.kind == "y":
            for cf, pos, _ in parts:
                total += int(cf.leaf_data(form, pos, i)[:, 1].sum())
    return total


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
