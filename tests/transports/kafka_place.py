"""How the shared suites open `kafka://`: a mock cluster for the session and its place.

For the contract suite (`tests/contract/transports.py`)::

    from tests.transports.kafka_place import kafka
    TRANSPORTS = {..., "kafka": kafka}

and, so the cluster is shared by every test of the session, in ``tests/conftest.py``::

    from tests.transports.kafka_place import kafka_url  # noqa: F401  (a fixture)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.transport.kafka_mock import MockCluster

SESSION_TIMEOUT = 6.0
"""Seconds before a silent member's partitions move (Kafka's default is 45)."""


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[str]:
    """A 3-broker mock Kafka cluster in its own process, up for the whole session."""
    with MockCluster(brokers=3) as cluster:
        yield cluster.url


def kafka(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> tuple[str, dict[str, Any]]:
    """The contract suite's place on `kafka://`: topics and groups are fresh per test already."""
    return request.getfixturevalue("kafka_url"), {"visibility_timeout": SESSION_TIMEOUT}
