"""Natural-looking photos for tests and benchmarks, made from a seed.

Real photos compress well as JPEG and poorly as PNG: large smooth regions (sky, walls),
edges between objects, and sensor noise over everything. :func:`photo` draws that: a
smooth two-axis gradient, a few soft-edged ellipses and rectangles, a low-frequency
texture and a little per-pixel noise. Saved as JPEG quality 90 such an image is about
0.5-1.5 bits per pixel, and as PNG several times that, as with a camera's photos.
"""

from __future__ import annotations

import io

import numpy as np

__all__ = ["jpeg_bytes", "photo"]


def photo(seed: int, width: int = 320, height: int = 240) -> np.ndarray:
    """An ``height x width x 3`` uint8 picture; the same for the same arguments."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y /= max(height - 1, 1)
    x /= max(width - 1, 1)
    base = rng.uniform(40, 200, 3).astype(np.float32)
    tilt = rng.uniform(-80, 80, (2, 3)).astype(np.float32)
    img = base + x[..., None] * tilt[0] + y[..., None] * tilt[1]
    for _ in range(int(rng.integers(3, 8))):
        cy, cx = rng.uniform(0, 1, 2)
        ry, rx = rng.uniform(0.05, 0.35, 2)
        colour = rng.uniform(0, 255, 3).astype(np.float32)
        if rng.random() < 0.5:
            d = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2
            mask = np.clip((1.0 - d) * 6.0, 0.0, 1.0)
        else:
            d = np.maximum(np.abs(y - cy) / ry, np.abs(x - cx) / rx)
            mask = np.clip((1.0 - d) * 12.0, 0.0, 1.0)
        shade = 0.75 + 0.25 * (y - cy)[..., None]
        img = img * (1 - mask[..., None]) + (colour * shade) * mask[..., None]
    # Low-frequency texture: coarse noise scaled up smoothly.
    gh, gw = max(height // 16, 2), max(width // 16, 2)
    coarse = rng.normal(0, 10, (gh, gw)).astype(np.float32)
    fy, fx = y * (gh - 1), x * (gw - 1)
    y0 = np.minimum(fy.astype(np.int64), gh - 2)
    x0 = np.minimum(fx.astype(np.int64), gw - 2)
    wy, wx = fy - y0, fx - x0
    smooth = (
        coarse[y0, x0] * (1 - wy) * (1 - wx)
        + coarse[y0 + 1, x0] * wy * (1 - wx)
        + coarse[y0, x0 + 1] * (1 - wy) * wx
        + coarse[y0 + 1, x0 + 1] * wy * wx
    )
    img += smooth[..., None]
    img += rng.normal(0, 3.0, img.shape).astype(np.float32)  # sensor noise
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(seed: int, width: int = 320, height: int = 240, quality: int = 90) -> bytes:
    """:func:`photo` encoded as a JPEG of ``quality``."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(photo(seed, width, height)).save(out, format="JPEG", quality=quality)
    return out.getvalue()
