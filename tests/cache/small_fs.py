"""Run a test body on a real, small filesystem: a tmpfs mounted for the test.

As root the tmpfs is mounted directly; otherwise the body runs in a subprocess inside a
private user and mount namespace (``unshare --user --map-root-user --mount``). Only when
neither is possible is the test skipped, with the reason. The tmpfs is always unmounted.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

_TIMEOUT_S = 60


def _mount(mnt: Path, size: str) -> subprocess.CompletedProcess[str]:
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)


def _unmount(mnt: Path) -> None:
    # A descriptor still open on it (a failing body) makes umount fail: detach lazily then.
    done = subprocess.run(["umount", str(mnt)], capture_output=True, timeout=_TIMEOUT_S)
    if done.returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=_TIMEOUT_S)


def run_mounted(module: str, body: str, mnt: str, size: str) -> None:
    """Mount, run ``module.body(mnt)``, unmount (used inside the namespace)."""
    import importlib

    path = Path(mnt)
    done = _mount(path, size)
    if done.returncode != 0:
        raise RuntimeError(f"mount in the namespace failed: {done.stderr.strip()}")
    try:
        getattr(importlib.import_module(module), body)(path)
    finally:
        _unmount(path)


def on_small_fs(body: Callable[[Path], None], tmp_path: Path, size: str = "8m") -> None:
    """Run ``body(mountpoint)`` with a ``size`` tmpfs mounted at ``mountpoint``."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = _mount(mnt, size)
    if done.returncode == 0:
        try:
            body(mnt)
        finally:
            _unmount(mnt)
        return
    code = (
        f"import sys; sys.path[:0] = {sys.path!r}; import small_fs; "
        f"small_fs.run_mounted({body.__module__!r}, {body.__name__!r}, {str(mnt)!r}, {size!r})"
    )
    try:
        ns = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
    except FileNotFoundError:
        pytest.skip(f"cannot mount a tmpfs ({done.stderr.strip()}) and no unshare command")
    if "mount in the namespace failed" in ns.stderr or "unshare:" in ns.stderr:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}; unshare: {ns.stderr[-500:]}")
    assert ns.returncode == 0, ns.stderr[-3000:]
