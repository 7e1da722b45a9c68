"""Settings: environment parsing, precedence, fast failure naming the variable."""

from __future__ import annotations

import logging

import pytest

from asynccache import ConfigError, Settings
from asynccache.config import as_size, launch_env, parse_size


def test_defaults_and_precedence():
    env = {"ASYNCCACHE_MAX_CONCURRENCY": "3", "ASYNCCACHE_PART_BYTES": "24MiB"}
    s = Settings.from_env(env)
    assert s.max_concurrency == 3 and s.part_bytes == 24 << 20 != Settings().part_bytes
    assert Settings.from_env(env, max_concurrency=5).max_concurrency == 5, "keyword wins"
    assert Settings.from_env(env, max_concurrency=None).max_concurrency == 3, "None = unset"
    assert Settings.from_env({}).retries == Settings().retries


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("ASYNCCACHE_MAX_CONCURRENCY", "lots"),
        ("ASYNCCACHE_MAX_CONCURRENCY", "0"),
        ("ASYNCCACHE_TIMEOUT_S", "-1"),
        ("ASYNCCACHE_PROGRESS", "maybe"),
        ("ASYNCCACHE_MAX_CACHE_BYTES", "12 parsecs"),
        ("ASYNCCACHE_LOG_LEVEL", "LOUD"),
        ("ASYNCCACHE_RETRIES", "-2"),
    ],
)
def test_bad_values_fail_naming_the_variable(var, value):
    with pytest.raises(ConfigError, match=var):
        Settings.from_env({var: value})


def test_unknown_variable_warns_with_its_name():
    with pytest.warns(UserWarning, match="ASYNCCACHE_MAX_CONCURENCY"):
        Settings.from_env({"ASYNCCACHE_MAX_CONCURENCY": "4"})


def test_unknown_keyword_is_an_error():
    with pytest.raises(ConfigError, match="bogus"):
        Settings.from_env({}, bogus=1)


@pytest.mark.parametrize(
    ("text", "n"),
    [("64MiB", 64 << 20), ("8M", 8 << 20), ("1g", 1 << 30), ("1000", 1000), ("1.5KiB", 1536)],
)
def test_sizes(text, n):
    assert parse_size(text) == n


def test_booleans():
    for raw, val in [("1", True), ("off", False), ("Yes", True), ("false", False)]:
        assert Settings.from_env({"ASYNCCACHE_PROGRESS": raw}).progress is val


def test_log_level_is_applied_only_when_set():
    logger = logging.getLogger("asynccache")
    before = logger.level
    try:
        Settings.from_env({}).configure_logging()
        assert logger.level == before
        Settings.from_env({"ASYNCCACHE_LOG_LEVEL": "debug"}).configure_logging()
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


def test_launch_env():
    assert launch_env({}) is None
    assert launch_env({"RANK": "1", "WORLD_SIZE": "4"}) == (1, 4)
    with pytest.raises(ConfigError, match="RANK"):
        launch_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        launch_env({"WORLD_SIZE": "two"})


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        Settings().retries = 1  # type: ignore[misc]


@pytest.mark.parametrize("value", ["64MB", "64MiB", "64m", 1 << 26, "67108864", 67108864.0])
def test_size_arguments_accept_what_the_environment_accepts(value):
    assert as_size(value, "chunk_bytes") == 1 << 26
    assert Settings.from_env({}, max_cache_bytes=value).max_cache_bytes == 1 << 26
    assert Settings.from_env({}, part_bytes=value).part_bytes == 1 << 26


@pytest.mark.parametrize("value", ["lots", "64XB", True, [64], 1.5])
def test_a_bad_size_argument_names_the_argument(value):
    with pytest.raises(ConfigError, match="max_cache_bytes must be a size"):
        Settings.from_env({}, max_cache_bytes=value)
