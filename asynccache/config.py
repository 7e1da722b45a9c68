"""Settings: one frozen dataclass, read from ``ASYNCCACHE_*`` in one place.

Precedence: keyword argument > environment variable > default. :meth:`Settings.from_env`
is the only code in the package that reads ``os.environ``; everything else receives a
``Settings`` (or an explicit mapping such as ``Settings.aws_env``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError

PREFIX = "ASYNCCACHE_"
DEFAULT_PART_BYTES = 8 << 20
DEFAULT_MAX_INDEX_BYTES = 64 << 20
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SIZE_SUFFIXES = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}


def default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "asynccache")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tuning knobs. Every field is ``ASYNCCACHE_<FIELD NAME IN CAPITALS>`` in the environment.

    Sizes accept suffixes (``64MiB``, ``8M``, ``1G``); booleans accept 1/0, true/false,
    yes/no, on/off.
    """

    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)
    max_cache_bytes: int = 50 << 30
    max_concurrency: int = 16
    prefetch_chunks: int = 4
    part_bytes: int = DEFAULT_PART_BYTES  # cloud links: parallel parts keep slow links full
    # The part size adapts to the link as downloads run (docs/tuning.md), starting from
    # part_bytes. None: adapt unless part_bytes was set (from_env, or a value other than
    # the default given here); an explicit ASYNCCACHE_PART_BYTES fixes the size.
    adaptive_parts: bool | None = None
    retries: int = 5
    timeout_s: float = 60.0
    # A body that delivers less than this over a stall window (timeout_s) counts as
    # stalled: a server trickling bytes must not hold a download's lock and slot forever.
    min_bytes_per_s: int = 4 << 10
    backoff_base_s: float = 0.2
    backoff_max_s: float = 10.0
    # Throttling answers (429, 503, SlowDown) are waited out for this many seconds of
    # backoff per request, however many they are; they don't count against retries.
    throttle_patience_s: float = 120.0
    # The most bytes an index.json may have (version 2 keeps it small; a version-1 index
    # holds an entry per chunk): a larger body is refused before it is read whole.
    max_index_bytes: int = DEFAULT_MAX_INDEX_BYTES
    log_level: str | None = None
    progress: bool = True
    verify_tls: bool = True
    durable: bool = True
    # Durable: fsync each chunk before its publish even where the file system keeps the
    # chunk's boot stamp, which makes that fsync unneeded (docs/cache.md, "Boot stamps").
    fsync_publish: bool = False
    # The most starting a CacheDataLoader's DataLoader workers may take while the first
    # batches built in the main process are handed out: a fork is milliseconds, spawn
    # and forkserver import torch in fresh interpreters (WorkerStartError past it).
    worker_start_s: float = 120.0
    # Item bytes a reader fetches by HTTP Range per epoch, before their chunks land, so
    # the first batch does not wait for whole chunks (0: never; docs/cache.md).
    first_read_bytes: int = 8 << 20
    # CacheDataLoader builds an epoch's first batch in the main process while its
    # DataLoader workers start; they begin at the batch after it (0: the workers make
    # every batch; docs/streaming.md).
    first_batch_here: bool = True
    # With DataLoader workers, the main process starts downloading each worker's first
    # chunks while the workers start, on a slow link; the workers then find them
    # downloading (off: each worker fetches its own; docs/tuning.md, "The workers' first
    # chunks": measured, it paid only where the workers were slow to start).
    head_start: bool = False
    # How the S3 and HTTP backends receive chunk parts: "direct" (our own HTTP/1.1
    # receiver, one reused buffer per connection, docs/storage.md) or "aiohttp".
    receive: str = "direct"

    def __post_init__(self) -> None:
        for name in ("max_cache_bytes", "part_bytes", "max_index_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_var(name)} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_concurrency",):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_var(name)} must be >= 1, got {getattr(self, name)!r}")
        for name in (
            "prefetch_chunks",
            "retries",
            "min_bytes_per_s",
            "first_read_bytes",
            "throttle_patience_s",
        ):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{_var(name)} must be >= 0, got {getattr(self, name)!r}")
        for name in ("timeout_s", "backoff_base_s", "backoff_max_s", "worker_start_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{_var(name)} must be > 0, got {getattr(self, name)!r}")
        if self.throttle_patience_s == float("inf"):
            raise ConfigError(f"{_var('throttle_patience_s')} must be finite (waits are bounded)")
        if self.receive not in ("direct", "aiohttp"):
            raise ConfigError(
                f"{_var('receive')} must be 'direct' or 'aiohttp', got {self.receive!r}"
            )
        if self.adaptive_parts is None:
            object.__setattr__(self, "adaptive_parts", self.part_bytes == DEFAULT_PART_BYTES)
        if self.log_level is not None:
            if self.log_level.upper() not in _LOG_LEVELS:
                raise ConfigError(
                    f"{_var('log_level')} must be one of {_LOG_LEVELS}, got {self.log_level!r}"
                )
            object.__setattr__(self, "log_level", self.log_level.upper())

    def configure_logging(self) -> None:
        """Set the ``asynccache`` logger's level when ``log_level`` is given (else leave it)."""
        if self.log_level is not None:
            logging.getLogger("asynccache").setLevel(self.log_level)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``environ`` (default ``os.environ``), then apply ``overrides``.

        Keyword overrides that are ``None`` are ignored, so callers can pass their own
        optional arguments straight through.

        Raises:
            ConfigError: a variable has a value of the wrong type or range; the message
                names the variable.
        """
        env = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX) :].lower()
            if name not in fields:
                warnings.warn(
                    f"unknown setting {key} is ignored (known: "
                    f"{', '.join(sorted(_var(n) for n in fields))})",
                    stacklevel=2,
                )
                continue
            values[name] = _parse(name, fields[name].type, raw)
        for name, value in overrides.items():
            if name not in fields:
                raise ConfigError(f"unknown setting {name!r}")
            if value is not None:
                if "bytes" in name.split("_"):
                    value = as_size(value, name)
                values[name] = value
        if "part_bytes" in values and values.get("adaptive_parts") is None:
            values["adaptive_parts"] = False  # a size chosen by hand stays fixed
        return cls(**values)

    @staticmethod
    def aws_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The storage variables, read here so backends never touch env.

        ``AWS_*`` (S3 endpoint, region, profile) and the other backends' own:
        ``STORAGE_EMULATOR_HOST`` (GCS), ``AZURE_STORAGE_*`` (Azure: connection string,
        account, key, SAS token, as the Azure CLI names them), ``HF_TOKEN`` and
        ``HF_ENDPOINT`` (Hugging Face Hub).
        """
        env = os.environ if environ is None else environ
        return {
            k: v
            for k, v in env.items()
            if k.startswith(_STORAGE_ENV_PREFIXES) or k in _STORAGE_ENV_NAMES
        }


_STORAGE_ENV_PREFIXES = ("AWS_", "AZURE_STORAGE_")
_STORAGE_ENV_NAMES = frozenset({"STORAGE_EMULATOR_HOST", "HF_TOKEN", "HF_ENDPOINT"})


def launch_env(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` set by a launcher such as torchrun, or None when unset.

    Raises:
        ConfigError: either is not an integer, or the rank is outside the world.
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env.get("RANK", "0")), int(env["WORLD_SIZE"])
    except ValueError as exc:
        raise ConfigError(
            f"RANK={env.get('RANK')!r} / WORLD_SIZE={env.get('WORLD_SIZE')!r} must be integers"
        ) from exc
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world


def local_env(environ: Mapping[str, str] | None = None) -> tuple[int | None, int] | None:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` set by a launcher such as torchrun (the rank's
    place on its node, and the ranks per node), or None when ``LOCAL_WORLD_SIZE`` is unset;
    ``LOCAL_RANK`` is None when unset.

    Raises:
        ConfigError: either is not an integer, ``LOCAL_WORLD_SIZE`` is below 1, or
            ``LOCAL_RANK`` is outside it.
    """
    env = os.environ if environ is None else environ
    if "LOCAL_WORLD_SIZE" not in env:
        return None
    try:
        size = int(env["LOCAL_WORLD_SIZE"])
    except ValueError as exc:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']!r} must be an integer"
        ) from exc
    if size < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE={size} must be at least 1")
    if "LOCAL_RANK" not in env:
        return None, size
    try:
        rank = int(env["LOCAL_RANK"])
    except ValueError as exc:
        raise ConfigError(f"LOCAL_RANK={env['LOCAL_RANK']!r} must be an integer") from exc
    if not 0 <= rank < size:
        raise ConfigError(f"LOCAL_RANK={rank} is outside LOCAL_WORLD_SIZE={size}")
    return rank, size


def _var(name: str) -> str:
    return PREFIX + name.upper()


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864. Raises ValueError on anything else."""
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = s[len(num) :].strip()
    if suffix not in _SIZE_SUFFIXES or not num:
        raise ValueError(text)
    return int(float(num) * _SIZE_SUFFIXES[suffix])


def as_size(value: Any, name: str) -> int:
    """A size argument as bytes: an int, or a string the environment accepts (``"64MB"``,
    ``"64MiB"``, ``"8M"``; suffixes are binary, ``MB`` = ``MiB``).

    Raises:
        ConfigError: ``value`` is neither; the message names the argument ``name``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            pass
    raise ConfigError(
        f"{name} must be a size in bytes: an integer or a string such as '64MB', '64MiB' "
        f"or '1G', got {value!r}"
    )


def _parse(name: str, typ: Any, raw: str) -> Any:
    typ = str(typ)
    try:
        if typ in ("bool", "bool | None"):
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        if typ == "int":
            return parse_size(raw) if "bytes" in name.split("_") else int(raw)
        if typ == "float":
            return float(raw)
        return raw
    except ValueError as exc:
        raise ConfigError(f"{_var(name)}={raw!r} is not a valid {typ}") from exc
