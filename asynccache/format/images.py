"""Encoded images: which bytes an image leaf keeps, and decoding encoded bytes on read.

Pure: bytes in, objects out. Where an image's original bytes come from (its open file, its
file name) is the caller's business: :func:`kept_bytes` only judges bytes it is handed.

The rule for a ``PIL.Image`` leaf (docs/format.md, "Images"):

* an image that came from a JPEG, PNG or WebP file (its ``format``), of one frame, whose
  original encoded bytes are at hand, is stored as those bytes when they decode, whole, to
  exactly this image: its pixels were never loaded (so nothing can have changed them) and
  the bytes give its mode and size, or they were loaded and the bytes give the same mode,
  size, pixels (and palette);
* any other image (made in memory, converted, edited, or from another format) is encoded
  losslessly, as PNG (or TIFF for modes PNG can't hold).

:class:`DecodeImages` is a transform for ``bytes`` leaves holding JPEG, PNG or WebP: it
opens them as images in the process that runs it (a DataLoader worker), lazily.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..errors import ConfigError, DataError

__all__ = ["KEPT_FORMATS", "DecodeImages", "image_format", "kept_bytes", "open_image"]

#: Formats whose original bytes an image leaf keeps.
KEPT_FORMATS = ("JPEG", "PNG", "WEBP")

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def image_format(data: Any) -> str | None:
    """``"JPEG"``, ``"PNG"`` or ``"WEBP"`` when ``data`` starts like one (else None)."""
    head = bytes(memoryview(data)[:16])
    if head[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if head[:8] == _PNG_MAGIC:
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ConfigError("images need Pillow: pip install 'asynccache[images]'") from exc
    return Image


def pixels_loaded(img: Any) -> bool:
    """The image's pixels were decoded (by ``load()``, or anything that reads or edits
    them). Before that, nothing can have changed them."""
    if "_im" in vars(img) or hasattr(type(img), "_im"):
        return getattr(img, "_im", None) is not None
    return vars(img).get("im") is not None  # Pillow before 10.1


def kept_bytes(img: Any, data: bytes | None) -> bool:
    """Whether ``data``, the bytes ``img`` was opened from, may be stored for it: they
    decode to exactly ``img`` (see the module docstring). Never raises on bad bytes."""
    fmt = getattr(img, "format", None)
    if data is None or fmt not in KEPT_FORMATS or image_format(data) != fmt:
        return False
    if getattr(img, "n_frames", 1) != 1:
        return False
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as src:
            if src.mode != img.mode or src.size != img.size or getattr(src, "n_frames", 1) != 1:
                return False
            src.load()  # the bytes decode whole (not truncated, not damaged)
            if not pixels_loaded(img):
                return True
            return bool(
                src.tobytes() == img.tobytes()
                and (src.mode != "P" or src.getpalette() == img.getpalette())
            )
    except Exception:  # bytes PIL can't read back are not kept
        return False


def open_image(data: bytes, codec: str, mode: str, size: Any, where: str) -> Any:
    """``data`` opened as a ``codec`` image, lazily (pixels decode on first use), checked
    against the ``mode`` and ``size`` recorded for it.

    Raises:
        DataError: the bytes are not such an image (names ``where``).
    """
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(data), formats=[codec])
    except Exception as exc:
        raise DataError(f"{where}: stored {codec} image does not open ({exc})") from exc
    if img.mode != mode or list(img.size) != list(size):
        raise DataError(
            f"{where}: image opens as {img.mode} {img.size}, expected {mode} {tuple(size)}"
        )
    return img


class DecodeImages:
    """A transform: ``bytes`` leaves of an item that hold JPEG, PNG or WebP become images.

    Runs where the transform runs (a DataLoader worker); picklable. Other leaves pass
    through untouched; containers (dict, list, tuple) are walked.

    Args:
        to: ``"pil"`` (a ``PIL.Image`` opened lazily: pixels decode on first use) or
            ``"numpy"`` (an ``HxWxC`` / ``HxW`` uint8 array, decoded now).
        keys: only these dict keys are looked at (None: every bytes leaf).
        mode: convert to this PIL mode (``"RGB"``) after opening; None keeps the file's.

    Raises (when called):
        DataError: bytes that start like an image but don't decode (names the key path).
    """

    def __init__(
        self, to: str = "pil", keys: Iterable[str] | None = None, mode: str | None = None
    ) -> None:
        if to not in ("pil", "numpy"):
            raise ConfigError(f"DecodeImages: to must be 'pil' or 'numpy', got {to!r}")
        _pil()
        self.to, self.mode = to, mode
        self.keys = None if keys is None else frozenset(keys)

    def __call__(self, item: Any) -> Any:
        return self._walk(item, "item", True)

    def _walk(self, obj: Any, path: str, selected: bool) -> Any:
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return self._decode(obj, path) if selected else obj
        if isinstance(obj, dict):
            keys = self.keys
            return {
                k: self._walk(v, f"{path}[{k!r}]", keys is None or k in keys)
                for k, v in obj.items()
            }
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            out = [self._walk(v, f"{path}[{i}]", selected) for i, v in enumerate(obj)]
            return out if isinstance(obj, list) else tuple(out)
        return obj

    def _decode(self, data: Any, path: str) -> Any:
        fmt = image_format(data)
        if fmt is None:
            return data
        Image = _pil()
        try:
            img = Image.open(io.BytesIO(bytes(data)), formats=[fmt])
            if self.mode is not None and img.mode != self.mode:
                img = img.convert(self.mode)
            if self.to == "numpy":
                return np.asarray(img)
        except Exception as exc:
            raise DataError(f"{path}: {fmt} bytes do not decode ({exc})") from exc
        return img

    def __repr__(self) -> str:
        return f"DecodeImages(to={self.to!r}, keys={self.keys and sorted(self.keys)!r})"


ImageBytes = Callable[[Any], "bytes | None"]


def open_file_bytes(img: Any) -> bytes | None:
    """The bytes of the file object ``img`` still holds open (``img.fp``: an image whose
    pixels were not loaded yet), read from its start and its position put back; None when
    it holds none, or it can't be read that way (not seekable).

    The one read this layer does: of a file object the caller handed in, inside the value
    being encoded, as ``img.load()`` itself would read it. A path is never opened here (the
    writer passes a source that reads ``img.filename``, see ``write/writer.py``).
    """
    fp = getattr(img, "fp", None)
    if fp is None or getattr(fp, "closed", False):
        return None
    try:
        if not fp.seekable():
            return None
        pos = fp.tell()
        try:
            fp.seek(0)
            data = fp.read()
        finally:
            fp.seek(pos)
    except (OSError, ValueError, AttributeError):
        return None
    return bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else None
