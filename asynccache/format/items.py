"""One item: a pytree of leaves <-> a msgpack header plus raw, aligned leaf buffers.

Byte layout of an item (all integers little-endian; offsets relative to the item's
first byte, which the chunk places on a 64-byte boundary)::

    u32 H | msgpack header (H bytes) | zero padding to 64 | buffer 0 | pad | buffer 1 ...

The header is ``[tree, buffers]``: ``buffers`` lists ``[offset, nbytes]`` per raw buffer
(offset relative to the item start, always a multiple of 64), and ``tree`` is the nested
structure, each node a short list whose first element is a tag:

=======  ===========================================  ==========================
tag      node                                          leaf value
=======  ===========================================  ==========================
``n``    ``["n"]``                                    None
``b``    ``["b", bool]``                              bool
``i``    ``["i", int]`` / ``["I", decimal str]``      int (64-bit / any size)
``f``    ``["f", float]``                             float
``s``    ``["s", str]``                               str
``y``    ``["y", buf]``                               bytes
``a``    ``["a", dtype, shape, buf]``                 numpy.ndarray (C order)
``g``    ``["g", dtype, raw bytes]``                  numpy scalar
``t``    ``["t", dtype, shape, buf]``                 torch.Tensor (any dtype)
``p``    ``["p", mode, [w, h], codec, buf(, "kept")]`` PIL image, stored encoded
``k``    ``["k", buf]``                               pickled object (opt-in only)
``l``    ``["l", [node...]]``                         list
``u``    ``["u", [node...]]``                         tuple
``d``    ``["d", [key node...], [value node...]]``    dict (key types kept)
``o``    ``["o", class, [field...], [node...]]``      namedtuple
``c``    ``["c", class, [field...], [node...]]``      dataclass instance
=======  ===========================================  ==========================

A ``p`` node ending in ``"kept"`` holds the bytes the image was opened from (JPEG, PNG or
WebP, see :mod:`.images`) and reads back as that image, opened lazily; without it, the
image was encoded losslessly (PNG, or TIFF).

``class`` is ``"module:qualname"``. On read the class is looked up among the modules the
reading process has already imported (reading never imports a module named by the data)
and must still be a namedtuple / dataclass with the same fields.

Buffers are aligned so numpy and torch leaves are views into the chunk's mapping
(zero-copy). This module is pure: bytes in, objects out.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from ..errors import ConfigError, DataError, SerializationError
from .images import ImageBytes, kept_bytes, open_file_bytes, open_image

ALIGN = 64
#: Buffers smaller than this are never compressed (not worth a copy on read).
COMPRESS_MIN = 1024
CODECS = ("zstd",)
_U32 = struct.Struct("<I")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def compressor(name: str) -> Any:
    """``compress(bytes-like) -> bytes`` for codec ``name``."""
    if name not in CODECS:
        raise ConfigError(f"unknown compression {name!r}; supported: {', '.join(CODECS)}")
    zstd = _zstd()
    return zstd.ZstdCompressor(level=3).compress


def decompressor(name: str) -> Any:
    """``decompress(bytes-like, size) -> bytes`` for codec ``name``."""
    if name not in CODECS:
        raise SerializationError(f"unknown compression codec {name!r} in the item header")
    zstd = _zstd()
    return lambda data, size: zstd.ZstdDecompressor().decompress(data, max_output_size=size)


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:
        raise ConfigError(
            "zstd compression needs zstandard: pip install 'asynccache[compression]'"
        ) from exc
    return zstandard


def align(n: int) -> int:
    """Round ``n`` up to the next multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Encoder:
    def __init__(self, allow_pickle: bool, image_bytes: ImageBytes | None = None) -> None:
        self.allow_pickle = allow_pickle
        self.image_bytes = image_bytes or open_file_bytes
        self.buffers: list[memoryview] = []

    def buf(self, data: Any) -> int:
        self.buffers.append(memoryview(data).cast("B"))
        return len(self.buffers) - 1

    def node(self, obj: Any) -> list[Any]:
        # Order matters: bool before int, numpy scalars before float/int.
        if obj is None:
            return ["n"]
        if isinstance(obj, bool):
            return ["b", obj]
        if isinstance(obj, np.generic):
            arr = np.asarray(obj)
            return ["g", arr.dtype.str, arr.tobytes()]
        if isinstance(obj, int):
            return ["i", int(obj)] if _INT64_MIN <= obj <= _INT64_MAX else ["I", str(int(obj))]
        if isinstance(obj, float):
            return ["f", float(obj)]
        if isinstance(obj, str):
            return ["s", obj]
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return ["y", self.buf(bytes(obj) if isinstance(obj, memoryview) else obj)]
        if isinstance(obj, np.ndarray):
            return self.ndarray(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self.tensor(obj, torch)
        pil = sys.modules.get("PIL.Image")
        if pil is not None and isinstance(obj, pil.Image):
            return self.image(obj)
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return ["u", [self.node(x) for x in obj]]
        if isinstance(obj, tuple):
            names: list[str] = list(obj._fields)  # type: ignore[attr-defined]
            return self.record("o", obj, names, list(obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = dataclasses.fields(obj)
            for f in fields:
                if not f.init:
                    raise SerializationError(
                        f"cannot store {_class_name(type(obj))}: field {f.name!r} is init=False, "
                        "so the dataclass can't be rebuilt on read; make it an init field "
                        "or store a dict"
                    )
            names = [f.name for f in fields]
            return self.record("c", obj, names, [getattr(obj, n) for n in names])
        if isinstance(obj, list):
            return ["l", [self.node(x) for x in obj]]
        if isinstance(obj, dict):
            return ["d", [self.node(k) for k in obj], [self.node(v) for v in obj.values()]]
        if self.allow_pickle:
            return ["k", self.buf(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))]
        raise SerializationError(
            f"cannot store a leaf of type {type(obj).__module__}.{type(obj).__qualname__}; "
            "convert it to a supported type or pass allow_pickle=True"
        )

    def record(self, tag: str, obj: Any, names: list[str], values: list[Any]) -> list[Any]:
        """A namedtuple or dataclass: its class, field names and field values."""
        cls = type(obj)
        name = _class_name(cls)
        if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
            raise SerializationError(
                f"cannot store {name}: a class defined inside a function or in __main__ "
                "can't be found by the process that reads the item; define it at the top "
                "level of an importable module"
            )
        nodes = []
        for field, value in zip(names, values, strict=True):
            try:
                nodes.append(self.node(value))
            except SerializationError as exc:
                raise SerializationError(f"field {field!r} of {name}: {exc}") from exc
        return [tag, f"{cls.__module__}:{cls.__qualname__}", names, nodes]

    def ndarray(self, arr: np.ndarray) -> list[Any]:
        if arr.dtype.hasobject or arr.dtype.fields is not None:
            if self.allow_pickle:
                return ["k", self.buf(pickle.dumps(arr, protocol=pickle.HIGHEST_PROTOCOL))]
            raise SerializationError(f"cannot store a numpy array of dtype {arr.dtype}")
        if not arr.flags.c_contiguous:  # (ascontiguousarray would turn 0-d into 1-d)
            arr = arr.copy(order="C")
        return ["a", arr.dtype.str, list(arr.shape), self.buf(arr.reshape(-1).view(np.uint8))]

    def tensor(self, t: Any, torch: Any) -> list[Any]:
        if t.layout != torch.strided or t.is_quantized:
            raise SerializationError(f"cannot store a {t.layout} / quantized tensor; densify it")
        t = t.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        return ["t", dtype, list(t.shape), self.buf(raw)]

    def image(self, img: Any) -> list[Any]:
        fmt = getattr(img, "format", None)
        if fmt is not None:
            data = self.image_bytes(img)
            if kept_bytes(img, data):
                assert data is not None
                return ["p", img.mode, list(img.size), fmt, self.buf(data), "kept"]
        codec = "PNG" if img.mode in _PNG_MODES else "TIFF"
        out = io.BytesIO()
        if codec == "PNG":
            img.save(out, format=codec, compress_level=1)
        else:
            img.save(out, format=codec)
        return ["p", img.mode, list(img.size), codec, self.buf(out.getbuffer())]


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# Tags whose value msgpack already decoded; the conversion only guards the type.
_SCALARS: dict[str, Any] = {"i": int, "s": str, "f": float, "b": bool, "I": int}

_PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I;16"})
_DTYPES: dict[str, np.dtype] = {}  # dtype strings of array leaves, parsed once


def encode(
    item: Any,
    *,
    allow_pickle: bool = False,
    compression: str | None = None,
    image_bytes: ImageBytes | None = None,
) -> list[memoryview | bytes]:
    """Serialize ``item``; returns the pieces to write back to back (header, pads, buffers).

    The total length is a multiple of :data:`ALIGN` so the next item stays aligned. With
    ``compression="zstd"``, buffers of at least :data:`COMPRESS_MIN` bytes are stored
    compressed when that saves at least a tenth (their leaves are then copies on read).

    ``image_bytes(img)``: the bytes a ``PIL`` image leaf was opened from, or None (default:
    what its still-open file object holds, :func:`.images.open_file_bytes`); an image keeps
    them when they decode to exactly that image (:func:`.images.kept_bytes`).

    Raises:
        SerializationError: ``item`` contains a leaf that can't be stored.
        ConfigError: unknown ``compression``, or zstandard is not installed.
    """
    enc = _Encoder(allow_pickle, image_bytes)
    tree = enc.node(item)
    codecs: list[list[Any]] = [[] for _ in enc.buffers]
    if compression is not None:
        compress = compressor(compression)
        for i, data in enumerate(enc.buffers):
            if data.nbytes >= COMPRESS_MIN:
                packed = compress(data)
                if len(packed) <= 0.9 * data.nbytes:
                    codecs[i] = [compression, data.nbytes]
                    enc.buffers[i] = memoryview(packed)
    # Offsets depend on the header length, which depends on the offsets' encoded size:
    # place buffers after a header encoded with final offsets, recomputing once if needed.
    sizes = [b.nbytes for b in enc.buffers]  # (after compression)
    header = b""
    start = 0
    while True:  # converges: offsets only grow, and the header grows slower than they do
        offsets, pos = [], start
        for n, codec in zip(sizes, codecs, strict=True):
            offsets.append([pos, n, *codec])
            pos = align(pos + n)
        header = msgpack.packb([tree, offsets], use_bin_type=True)
        needed = align(_U32.size + len(header))
        if needed <= start:
            break
        start = needed
    pieces: list[memoryview | bytes] = [_U32.pack(len(header)), header]
    pos = _U32.size + len(header)
    for (off, n, *_codec), data in zip(offsets, enc.buffers, strict=True):
        pieces.append(b"\0" * (off - pos))
        pieces.append(data)
        pos = off + n
    pieces.append(b"\0" * (align(pos) - pos))
    return pieces


def encoded_size(pieces: Sequence[memoryview | bytes]) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)


def decode(buf: Any, start: int, end: int, *, where: str, allow_pickle: bool = False) -> Any:
    """Rebuild the item stored in ``buf[start:end]`` (``buf``: an mmap or bytes-like).

    numpy and torch leaves are views into ``buf`` (no copy); bytes/str/images are copied.

    Raises:
        DataError: the bytes are not a valid item; the message contains ``where``.
    """
    view = memoryview(buf)
    if end - start < _U32.size or end > len(view):
        raise DataError(f"{where}: item bytes [{start}, {end}) are out of range")
    (hlen,) = _U32.unpack_from(view, start)
    if _U32.size + hlen > end - start:
        raise DataError(f"{where}: item header length {hlen} exceeds the item")
    try:
        tree, offsets = msgpack.unpackb(
            view[start + _U32.size : start + _U32.size + hlen],
            raw=False,
            use_list=True,
            strict_map_key=False,
        )
        spans = []
        size = end - start
        for entry in offsets:
            off, n = entry[0], entry[1]
            if off < 0 or n < 0 or off + n > size:
                raise DataError(f"{where}: buffer [{off}, {off + n}) lies outside the item")
            spans.append((start + off, n) if len(entry) == 2 else (start + off, n, *entry[2:]))
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{where}: malformed item header ({exc})") from exc
    dec = _Decoder(buf, view, spans, where, allow_pickle)
    try:
        return dec.node(tree)
    except (DataError, SerializationError):
        raise
    except Exception as exc:
        raise DataError(f"{where}: malformed item ({type(exc).__name__}: {exc})") from exc


class _Decoder:
    def __init__(
        self,
        buf: Any,
        view: memoryview,
        spans: list[tuple[Any, ...]],
        where: str,
        allow_pickle: bool,
    ) -> None:
        self.buf, self.view, self.spans, self.where = buf, view, spans, where
        self.allow_pickle = allow_pickle

    def node(self, n: list[Any]) -> Any:
        tag = n[0]
        conv = _SCALARS.get(tag)  # most frequent first: this runs for every leaf
        if conv is not None:
            return conv(n[1])
        if tag == "a":
            return self.ndarray(n[1], n[2], n[3])
        if tag == "t":
            return self.tensor(n[1], n[2], n[3])
        if tag == "d":  # (str keys, the most frequent, without a call)
            node = self.node
            return {
                (k[1] if k[0] == "s" and type(k[1]) is str else node(k)): node(v)
                for k, v in zip(n[1], n[2], strict=True)
            }
        if tag == "n":
            return None
        if tag == "y":
            buf, off, size = self.raw(n[1])
            return bytes(memoryview(buf)[off : off + size])
        if tag == "g":
            return np.frombuffer(n[2], dtype=np.dtype(n[1]))[0]
        if tag == "p":
            if len(n) > 5 and n[5] == "kept":
                buf, off, size = self.raw(n[4])
                data = bytes(memoryview(buf)[off : off + size])
                return open_image(data, n[3], n[1], n[2], self.where)
            return self.image(n[1], n[2], n[3], n[4])
        if tag == "l":
            return [self.node(x) for x in n[1]]
        if tag == "u":
            return tuple(self.node(x) for x in n[1])
        if tag in ("o", "c"):
            return self.record(tag, n[1], n[2], n[3])
        if tag == "k":
            if not self.allow_pickle:
                raise DataError(
                    f"{self.where}: item holds a pickled leaf; pass allow_pickle=True "
                    "to read it (only for data you trust)"
                )
            buf, off, size = self.raw(n[1])
            return pickle.loads(memoryview(buf)[off : off + size])
        raise DataError(f"{self.where}: unknown leaf tag {tag!r}")

    def record(self, tag: str, name: str, fields: list[str], nodes: list[Any]) -> Any:
        """Rebuild a namedtuple (``o``) or dataclass (``c``) of class ``name``."""
        module, _, qualname = name.partition(":")
        what = "namedtuple" if tag == "o" else "dataclass"
        mod = sys.modules.get(module)
        if mod is None:
            raise DataError(
                f"{self.where}: the item holds a {what} {qualname} from module {module}, which "
                f"this process has not imported; import {module} before reading"
            )
        cls: Any = mod
        for part in qualname.split("."):
            cls = getattr(cls, part, None)
        if tag == "o":
            have = list(getattr(cls, "_fields", ())) if isinstance(cls, type) else None
            ok = have is not None and issubclass(cls, tuple)
        else:
            ok = isinstance(cls, type) and dataclasses.is_dataclass(cls)
            have = [f.name for f in dataclasses.fields(cls) if f.init] if ok else None
        if not ok:
            raise DataError(
                f"{self.where}: the item holds a {what} {module}.{qualname}, which is not a "
                f"{what} in this process"
            )
        if have != fields:
            missing = [f for f in fields if f not in (have or [])]
            extra = [f for f in (have or []) if f not in fields]
            field = (missing or extra or fields)[0]
            raise DataError(
                f"{self.where}: can't rebuild {module}.{qualname}: field {field!r} "
                f"{'is no longer in the class' if missing else 'was not stored'} "
                f"(stored fields {fields}, the class has {have})"
            )
        values = [self.node(x) for x in nodes]
        if tag == "o":
            return cls(*values)
        return cls(**dict(zip(fields, values, strict=True)))

    def raw(self, idx: int) -> tuple[Any, int, int]:
        """``(buffer, offset, size)`` of raw buffer ``idx``: the chunk itself, or a
        decompressed, writable copy."""
        off, size, *codec = self.spans[idx]
        if not codec:
            return self.buf, off, size
        name, raw_size = codec
        try:
            data = decompressor(name)(self.view[off : off + size], raw_size)
        except (ConfigError, SerializationError):
            raise
        except Exception as exc:
            raise DataError(f"{self.where}: corrupt {name} buffer ({exc})") from exc
        if len(data) != raw_size:
            raise DataError(f"{self.where}: {name} buffer holds {len(data)} bytes, not {raw_size}")
        return bytearray(data), 0, raw_size

    def _span(self, idx: int, itemsize: int, shape: list[int]) -> tuple[Any, int, int]:
        span = self.spans[idx]
        buf, off, size = (self.buf, *span) if len(span) == 2 else self.raw(idx)
        count = math.prod(shape)
        if count * itemsize != size:
            raise DataError(f"{self.where}: buffer of {size} bytes doesn't hold shape {shape}")
        return buf, off, count

    def ndarray(self, dtype: str, shape: list[int], idx: int) -> np.ndarray:
        dt = _DTYPES.get(dtype)
        if dt is None:
            dt = np.dtype(dtype)
            if len(_DTYPES) < 256:
                _DTYPES[dtype] = dt
        buf, off, count = self._span(idx, dt.itemsize, shape)
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=off)
        return arr if len(shape) == 1 else arr.reshape(shape)

    def tensor(self, dtype: str, shape: list[int], idx: int) -> Any:
        import torch

        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise DataError(f"{self.where}: unknown torch dtype {dtype!r}")
        buf, off, count = self._span(idx, dt.itemsize, shape)
        if count == 0:
            return torch.empty(shape, dtype=dt)
        if memoryview(buf).readonly:  # torch tensors must be writable: copy read-only memory
            buf, off = bytearray(memoryview(buf)[off : off + count * dt.itemsize]), 0
        return torch.frombuffer(buf, dtype=dt, count=count, offset=off).reshape(shape)

    def image(self, mode: str, size: list[int], codec: str, idx: int) -> Any:
        from PIL import Image

        buf, off, n = self.raw(idx)
        with Image.open(io.BytesIO(bytes(memoryview(buf)[off : off + n])), formats=[codec]) as f:
            img = f.copy()  # a plain Image, like the one written, not a PngImageFile
        if img.mode != mode or list(img.size) != list(size):
            raise DataError(
                f"{self.where}: image decodes as {img.mode} {img.size}, "
                f"expected {mode} {tuple(size)}"
            )
        return img
