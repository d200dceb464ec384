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

SESSION_TIMEOUT = 1.5
"""Seconds before a silent member's partitions move, for every member of every Kafka test (Kafka's
default is 45; a real cluster refuses less than its ``group.min.session.timeout.ms``, 6 s).
librdkafka's mock cluster takes any, and its groups wait on it: it answers the JoinGroups of a
rebalance only after the session timeout less 1 s (a member joining, leaving or killed: all wait that
long), and drops a killed member after the session timeout (looked at once a second). A kill stalled
the group 4.7 s at 3 s and 1.9-4.5 s at 1.5 s (tests/README.md). Members of one group share the
value: the mock sizes a rebalance's wait by the session of a member that joined before, and a member
whose own session is far shorter does not wait that long for its JoinGroup, joins again and again and
is never assigned anything (a killed child at 6 s, its survivor at 1.5 s: nothing fetched in 60 s)."""


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[str]:
    """A 3-broker mock Kafka cluster in its own process, up for the whole session."""
    with MockCluster(brokers=3) as cluster:
        yield cluster.url


def kafka(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> tuple[str, dict[str, Any]]:
    """The contract suite's place on `kafka://`: topics and groups are fresh per test already."""
    return request.getfixturevalue("kafka_url"), {"visibility_timeout": SESSION_TIMEOUT}
