"""Item headers in bulk: many items' msgpack headers decoded at once, with numpy.

An item's header (:mod:`.items`) is ``msgpack([tree, buffers])``. Items written by one
function usually share everything in it but their values: the tags, the dict keys,
dtypes, shapes and buffer indices are the same bytes, and only scalar leaf values
(ints, floats, bools, strings, numpy scalars) and the buffers' ``[offset, nbytes]``
differ. A :class:`Template` is one header cut at those values: runs of bytes every
matching header must hold verbatim, and *slots* between them. :func:`match` runs a
template over the headers of many items at once (one row each, see :func:`gather`),
one vectorised step per run or slot, and returns each slot's values as a column.
The headers come from one gather of the chunk's bytes (:func:`lengths`, :func:`gather`).

Invariant: a row that :func:`match` accepts is a header that :func:`.items.decode`
reads as the template's exemplar with the slot values substituted; every byte of the
row up to its length was checked (a row that differs anywhere is rejected, never
misread). Rows it rejects are the caller's to parse another way.

Pure: bytes and numpy arrays in, numpy arrays out.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

__all__ = ["Slot", "Template", "compile_header", "gather", "lengths", "match"]

_U32 = struct.Struct("<I")

# Per msgpack type byte: payload bytes of an int (-1: not an int), its kind.
_INT_BYTES = np.full(256, -1, np.int64)
_INT_BYTES[0x00:0x80] = 0  # positive fixint
_INT_BYTES[0xE0:0x100] = 0  # negative fixint
_INT_BYTES[[0xCC, 0xCD, 0xCE, 0xCF]] = [1, 2, 4, 8]
_INT_BYTES[[0xD0, 0xD1, 0xD2, 0xD3]] = [1, 2, 4, 8]
_SIGNED = np.zeros(256, bool)
_SIGNED[[0xD0, 0xD1, 0xD2, 0xD3]] = True
_SIGNED[0xE0:0x100] = True
# str: bytes of the length field after the type byte (-1: not a str).
_STR_LEN = np.full(256, -1, np.int64)
_STR_LEN[0xA0:0xC0] = 0
_STR_LEN[[0xD9, 0xDA, 0xDB]] = [1, 2, 4]

_TAKE = 9  # bytes gathered at a slot: a type byte and up to 8 of payload
TAKE = _TAKE  # columns a row needs past its header


@dataclasses.dataclass(frozen=True)
class Slot:
    """A value cut out of a template: its column ``index`` and ``kind`` (``"int"``,
    ``"float"``, ``"bool"``, ``"str"`` or ``"raw"``: ``width`` bytes of a bin)."""

    index: int
    kind: str
    width: int = 0


@dataclasses.dataclass(frozen=True)
class Template:
    """A header with its values cut out.

    ``steps``: in byte order, ``bytes`` (a run every matching header holds) or a
    :class:`Slot`. ``tree`` and ``buffers``: the exemplar's header as
    ``msgpack.unpackb`` returns it, each value that is a slot replaced by its
    :class:`Slot` (dict keys, tags, dtypes, shapes and buffer indices are never slots).
    """

    steps: tuple[bytes | Slot, ...]
    tree: Any
    buffers: Any
    slots: tuple[Slot, ...]


class _Cut:
    """Reads one header, byte by byte, into a template."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0
        self.steps: list[bytes | Slot] = []
        self.slots: list[Slot] = []
        self._run = 0  # where the pending run of verbatim bytes starts

    # -- raw msgpack -----------------------------------------------------------------
    def _byte(self) -> int:
        b = self.data[self.pos]
        self.pos += 1
        return b

    def _uint(self, n: int) -> int:
        v = int.from_bytes(self.data[self.pos : self.pos + n], "big")
        if self.pos + n > len(self.data):
            raise ValueError("header ends inside a value")
        self.pos += n
        return v

    def _array(self) -> int:
        t = self._byte()
        if 0x90 <= t <= 0x9F:
            return t & 0x0F
        if t == 0xDC:
            return self._uint(2)
        if t == 0xDD:
            return self._uint(4)
        raise ValueError(f"expected an array, got type byte {t:#x}")

    def _value(self) -> Any:
        """One msgpack object, decoded (verbatim bytes: no slot)."""
        t = self._byte()
        if t <= 0x7F:
            return t
        if t >= 0xE0:
            return t - 0x100
        if 0xA0 <= t <= 0xBF:
            return self._str(t & 0x1F)
        if 0x90 <= t <= 0x9F:
            return [self._value() for _ in range(t & 0x0F)]
        if t == 0xC0:
            return None
        if t in (0xC2, 0xC3):
            return t == 0xC3
        if t in (0xCC, 0xCD, 0xCE, 0xCF):
            return self._uint(1 << (t - 0xCC))
        if t in (0xD0, 0xD1, 0xD2, 0xD3):
            n = 1 << (t - 0xD0)
            v = self._uint(n)
            return v - (1 << (8 * n)) if v >> (8 * n - 1) else v
        if t == 0xCA:
            v = struct.unpack(">f", self.data[self.pos : self.pos + 4])[0]
            self.pos += 4
            return v
        if t == 0xCB:
            v = struct.unpack(">d", self.data[self.pos : self.pos + 8])[0]
            self.pos += 8
            return v
        if t in (0xD9, 0xDA, 0xDB):
            return self._str(self._uint(1 << (t - 0xD9)))
        if t in (0xC4, 0xC5, 0xC6):
            return self._bin(self._uint(1 << (t - 0xC4)))
        if t == 0xDC:
            return [self._value() for _ in range(self._uint(2))]
        if t == 0xDD:
            return [self._value() for _ in range(self._uint(4))]
        raise ValueError(f"unsupported msgpack type byte {t:#x}")

    def _str(self, n: int) -> str:
        return self._bin(n).decode("utf-8")

    def _bin(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("header ends inside a value")
        v = self.data[self.pos : self.pos + n]
        self.pos += n
        return bytes(v)

    # -- slots ---------------------------------------------------------------------
    def _slot(self, kind: str, width: int = 0) -> Slot:
        """The value at ``pos`` becomes a slot (it is read, to step over it)."""
        if self.pos > self._run:
            self.steps.append(bytes(self.data[self._run : self.pos]))
        slot = Slot(len(self.slots), kind, width)
        start = self.pos
        if kind == "raw":
            self.pos += width
            if self.pos > len(self.data):
                raise ValueError("header ends inside a value")
        else:
            v = self._value()
            ok = {
                "int": isinstance(v, int) and not isinstance(v, bool),
                "float": isinstance(v, float) and self.data[start] == 0xCB,
                "bool": isinstance(v, bool),
                "str": isinstance(v, str),
            }[kind]
            if not ok:
                raise ValueError(f"expected a {kind} value")
        self.slots.append(slot)
        self.steps.append(slot)
        self._run = self.pos
        return slot

    def node(self, key: bool) -> list[Any]:
        """A tree node; its values become slots unless it is a dict key (``key``)."""
        n = self._array()
        if n < 1:
            raise ValueError("empty tree node")
        tag = self._value()
        if not isinstance(tag, str):
            raise ValueError("tree node without a tag")
        rest: list[Any] = []
        if tag in ("i", "f", "b", "s", "I") and n == 2:
            kind = {"i": "int", "f": "float", "b": "bool", "s": "str", "I": "str"}[tag]
            rest.append(self._value() if key else self._slot(kind))
        elif tag == "g" and n == 3:
            rest.append(self._value())  # dtype
            start = self.pos
            t = self._byte()
            if t not in (0xC4, 0xC5, 0xC6):
                raise ValueError("numpy scalar without bin bytes")
            width = self._uint(1 << (t - 0xC4))
            if key:
                self.pos = start
                rest.append(self._value())
            else:
                rest.append(self._slot("raw", width))
        elif tag in ("l", "u") and n == 2:
            rest.append([self.node(False) for _ in range(self._array())])
        elif tag == "d" and n == 3:
            rest.append([self.node(True) for _ in range(self._array())])
            rest.append([self.node(key) for _ in range(self._array())])
        elif tag in ("o", "c") and n == 4:
            rest += [self._value(), self._value()]
            rest.append([self.node(key) for _ in range(self._array())])
        else:  # n, y, a, t, p, k and anything unknown: verbatim
            rest += [self._value() for _ in range(n - 1)]
        return [tag, *rest]

    def header(self) -> tuple[Any, Any]:
        if self._array() != 2:
            raise ValueError("a header is [tree, buffers]")
        tree = self.node(False)
        buffers = []
        for _ in range(self._array()):
            m = self._array()
            if m < 2:
                raise ValueError("a buffer entry is [offset, nbytes, codec...]")
            entry: list[Any] = [self._slot("int"), self._slot("int")]
            entry += [self._value() for _ in range(m - 2)]
            buffers.append(entry)
        if self.pos != len(self.data):
            raise ValueError("bytes after the header")
        if self.pos > self._run:
            self.steps.append(bytes(self.data[self._run : self.pos]))
        return tree, buffers


def compile_header(data: bytes) -> Template | None:
    """The template of one header (the msgpack bytes after the length word); None when
    the bytes are not a header this module reads (the caller parses it another way)."""
    cut = _Cut(data)
    try:
        tree, buffers = cut.header()
    except (ValueError, IndexError, UnicodeDecodeError, struct.error):
        return None
    return Template(tuple(cut.steps), tree, buffers, tuple(cut.slots))


def lengths(u8: np.ndarray, starts: np.ndarray, ends: np.ndarray, cap: int) -> np.ndarray:
    """The header length of each item ``[starts[j], ends[j])`` of ``u8`` (a chunk's
    bytes); -1 where the item can't hold its header, or the header is longer than
    ``cap``. One gather of the length words."""
    m = len(starts)
    if not m:
        return np.zeros(0, np.int64)
    word = _rows(u8, starts, 4)
    hlen = word.view("<u4").reshape(m).astype(np.int64)
    ok = (ends - starts >= 4) & (hlen + 4 <= ends - starts) & (hlen <= cap)
    return np.where(ok, hlen, -1)


def gather(u8: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The headers (:func:`lengths` ``lens``) of the items starting at ``starts`` of
    ``u8``, as rows of one uint8 matrix, each the bytes after the item's length word
    (past its header: whatever follows, never read by :func:`match`): one gather."""
    return _rows(u8, starts + 4, int(lens.max(initial=0)) + _TAKE)


def _rows(u8: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``u8[s : s + width]`` for each ``s`` of ``starts``, as rows (zero past ``u8``)."""
    m = len(starts)
    out = np.zeros((m, width), np.uint8)
    fits = starts + width <= len(u8)
    if len(u8) >= width:
        windows = np.lib.stride_tricks.sliding_window_view(u8, width)
        if fits.all():
            return windows[starts]
        out[fits] = windows[starts[fits]]
    for j in np.flatnonzero(~fits).tolist():  # (the last items of the chunk, if any)
        s = int(starts[j])
        tail = u8[s : s + width]
        out[j, : len(tail)] = tail
    return out


def _realign(work: np.ndarray, cur: int, adv: np.ndarray) -> np.ndarray:
    """The bytes of each row of ``work`` from column ``cur + adv`` on, as rows of a new
    matrix (zero-filled at the end)."""
    lo, hi = int(adv.min()), int(adv.max())
    width = work.shape[1] - cur - lo
    if hi - lo <= 16:
        out = np.zeros((len(work), width), np.uint8)
        for d in range(lo, hi + 1):
            sel = adv == d
            if sel.any():
                out[sel, : width - (d - lo)] = work[sel, cur + d :]
        return out
    cols = np.minimum(np.arange(width)[None, :] + (cur + adv)[:, None], work.shape[1] - 1)
    return np.take_along_axis(work, cols, axis=1)


def _same(block: np.ndarray, want: bytes) -> np.ndarray:
    """Rows of ``block`` (``len(want)`` columns) equal to ``want``, compared 8 bytes at
    a time."""
    m, w = block.shape
    w8 = -(-w // 8) * 8
    words = np.zeros((m, w8), np.uint8)
    words[:, :w] = block
    target = np.frombuffer(want.ljust(w8, b"\0"), "<u8")
    eq = words.view("<u8") == target
    return eq[:, 0] if w8 == 8 else eq.all(axis=1)


def match(tpl: Template, rows: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """Which headers (rows of :func:`gather`, of lengths ``lens``; -1: none) ``tpl``
    reads, and its slots' columns.

    Returns ``ok`` (bool per row) and one column per slot, valid where ``ok``: int64
    values (``int``), float64 (``float``), bool (``bool``), ``(m, width)`` uint8 bytes
    (``raw``), or an ``(m, 2)`` int64 of each string's start in its row and its length
    in bytes (``str``).

    The rows are read in lockstep: one cursor for all of them while the values read so
    far have had the same width in every row; after a value whose width differs, the
    rest of each row is moved so that its next byte is in column 0 again (``base``:
    the column of the original row that column 0 now holds).
    """
    m = len(rows)
    ok = lens >= 0
    blank = [np.zeros((m, 2), np.int64) if s.kind == "str" else np.zeros(m) for s in tpl.slots]
    if not m:
        return ok, blank
    work = rows
    cur = 0
    base = np.zeros(m, np.int64)
    cols: list[Any] = []
    for step in tpl.steps:
        width = work.shape[1]
        if cur + max(_TAKE, len(step) if isinstance(step, bytes) else 0) > width:
            ok[:] = False  # past every header (a valid row always has these bytes)
            return ok, blank
        adv: Any = 0
        if isinstance(step, bytes):
            ok &= _same(work[:, cur : cur + len(step)], step)
            cur += len(step)
        elif step.kind == "raw":
            cols.append(np.ascontiguousarray(work[:, cur : cur + step.width]))
            cur += step.width
        else:
            t = work[:, cur]
            be = np.ascontiguousarray(work[:, cur + 1 : cur + _TAKE]).view(">u8").reshape(m)
            cur += 1
            if step.kind == "int":
                nb = _INT_BYTES[t]
                ok &= nb >= 0
                nb = np.maximum(nb, 0)
                shift_bits = (8 * (8 - np.maximum(nb, 1))).astype(np.uint64)
                val = (be >> shift_bits).astype(np.int64)  # int64 two's complement: d3 as is
                small = _SIGNED[t] & (nb > 0) & (nb < 8)  # d0-d2: sign-extend
                bits = np.where(small, 8 * nb, 1)
                val = np.where(small & ((val >> (bits - 1)) & 1 == 1), val - (1 << bits), val)
                ok &= ~((t == 0xCF) & (val < 0))  # a uint64 past int64: not an int64 leaf
                tv = t.astype(np.int64)
                val = np.where(nb == 0, np.where(tv >= 0xE0, tv - 0x100, tv), val)
                cols.append(val)
                adv = nb
            elif step.kind == "float":
                ok &= t == 0xCB
                cols.append(be.view(">f8").astype(np.float64))
                adv = 8
            elif step.kind == "bool":
                ok &= (t == 0xC2) | (t == 0xC3)
                cols.append(t == 0xC3)
            else:  # str
                lb = _STR_LEN[t]
                ok &= lb >= 0
                lb = np.maximum(lb, 0)
                shift_bits = (8 * (8 - np.maximum(lb, 1))).astype(np.uint64)
                n = np.where(lb > 0, (be >> shift_bits).astype(np.int64), t.astype(np.int64) & 0x1F)
                cols.append(np.stack([base + cur + lb, n], axis=1))
                adv = lb + n
        if isinstance(adv, int):
            cur += adv
        else:
            adv = np.where(ok, adv, 0)
            lo = int(adv.min())
            if int(adv.max()) == lo:
                cur += lo
            else:  # rows go on at different columns: bring each one's next byte to 0
                work = _realign(work, cur, adv)
                base += cur + adv
                cur = 0
        ok &= base + cur <= lens
    ok &= base + cur == lens
    return ok, cols
