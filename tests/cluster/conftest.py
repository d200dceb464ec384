"""Fixtures of the cluster tests: clusters on loopback, started and stopped by the test itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.nats_cluster import NatsCluster
from tests.transports.conftest import effects

__all__ = ["effects"]


@pytest.fixture
def nats_cluster(tmp_path: Path, unique: str) -> Iterator[NatsCluster]:
    """A 3-node JetStream cluster of the machine's nats-server, its stores under ``tmp_path``."""
    with NatsCluster(tmp_path / "nats", unique) as cluster:
        yield cluster
