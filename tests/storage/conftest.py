"""Emulator fixtures for the cloud backends: each server starts once per run, stopped by PID.

* ``gcs_emulator`` (session): fake-gcs-server; ``gcs_bucket`` (function): a fresh bucket.
* ``azurite`` (session): Azurite's blob service; ``az_container`` (function): a fresh
  container.
* ``hub`` (function): the Hugging Face Hub's resolve and tree endpoints plus a CDN.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest

from asynccache.testing.azurite import Azurite
from asynccache.testing.gcs_emulator import GcsEmulator
from asynccache.testing.hubserver import HubServer


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    """One fake-gcs-server for the whole run."""
    with GcsEmulator() as server:
        assert isinstance(server, GcsEmulator)
        yield server


@pytest.fixture
def gcs_bucket(gcs_emulator: GcsEmulator) -> Iterator[str]:
    """A fresh GCS bucket, deleted (with its objects) after the test."""
    name = f"t-{uuid.uuid4().hex[:16]}"
    gcs_emulator.create_bucket(name)
    yield name
    with contextlib.suppress(Exception):
        gcs_emulator.delete_bucket(name)


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    """One Azurite blob service for the whole run."""
    with Azurite() as server:
        assert isinstance(server, Azurite)
        yield server


@pytest.fixture
def az_container(azurite: Azurite) -> Iterator[str]:
    """A fresh container, deleted (with its blobs) after the test."""
    name = f"t-{uuid.uuid4().hex[:16]}"
    azurite.create_container(name)
    yield name
    with contextlib.suppress(Exception):
        azurite.delete_container(name)


@pytest.fixture
def hub() -> Iterator[HubServer]:
    """A Hugging Face Hub imitation (Hub plus CDN, two origins) on loopback."""
    with HubServer(page_size=2) as server:
        yield server
