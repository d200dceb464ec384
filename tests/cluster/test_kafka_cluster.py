"""Handlers ride through a partition leader going down on librdkafka's 3-broker mock cluster.

The mock cluster (`MockCluster`, a process of its own) is driven through
librdkafka's mock API: during one run (`tests.cluster.run`) a broker leading
partitions of the topic is taken down and brought back (the partitions have
no reachable leader meanwhile), then another leader is taken down and its
partitions' leadership moved to a live broker (an election) before it comes
back. Every effect must be in PostgreSQL once and every poison message
dead-lettered once. The broker that answers as controller is never the one
taken down, and the group's coordinator is pinned to it: the mock cluster
moves neither by itself, and a real cluster moves both with partition
leadership.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from backends.errors import ConfigurationError
from backends.transport.kafka import KafkaTransport
from backends.transport.kafka_mock import CONTROLLER, MockCluster
from backends.types import OutgoingMessage
from tests.cluster.run import ClusterRun, Failure
from tests.transports.kafka_place import SESSION_TIMEOUT

BROKERS = (1, 2, 3)
"""The mock cluster's broker ids."""


@pytest.fixture
def mock_cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=len(BROKERS)) as cluster:
        yield cluster


def leaders(cluster: MockCluster, topic: str) -> dict[int, int]:
    """Partition -> the broker leading it, as the cluster's metadata says."""
    producer = Producer({"bootstrap.servers": cluster.url.removeprefix("kafka://")})
    metadata = producer.list_topics(topic, timeout=30).topics[topic]
    return {partition: info.leader for partition, info in metadata.partitions.items()}


def kafka_run(cluster: MockCluster, postgres_url: str, effects: str, topic: str, count: int, log_dir: Path,
              rounds: int) -> ClusterRun:
    def a_leader() -> int:
        """A broker other than the controller that leads a partition of the topic."""
        led = sorted(set(leaders(cluster, topic).values()) - {CONTROLLER})
        if not led:  # the mock gives each partition a random leader: here all drew the controller
            cluster.set_leader(topic, 0, BROKERS[-1])  # an election moves one off it
            led = sorted(set(leaders(cluster, topic).values()) - {CONTROLLER})
            assert led == [BROKERS[-1]], f"partition 0's leadership did not move: {leaders(cluster, topic)}"
        return led[0]

    def down() -> str:
        broker = a_leader()
        cluster.set_down(broker)
        return str(broker)

    def down_and_elect() -> str:
        broker = a_leader()
        cluster.set_down(broker)
        elected = next(b for b in BROKERS if b not in (broker, CONTROLLER))  # leaders stay off the controller
        for partition, leader in leaders(cluster, topic).items():
            if leader == broker:
                cluster.set_leader(topic, partition, elected)
        assert broker not in leaders(cluster, topic).values()  # the partitions have a new leader
        return str(broker)

    def back(broker: str) -> None:
        cluster.set_up(int(broker))

    cluster.set_coordinator(topic, CONTROLLER)  # the worker's group is named after the topic
    kinds = [("partition leader down, back", down), ("leader down, new one elected", down_and_elect)]
    steps = [kinds[i % len(kinds)] for i in range(len(kinds) * rounds)]
    failures = [Failure(name, (i + 1) / (len(steps) + 1), inject, back) for i, (name, inject) in enumerate(steps)]
    env = {
        "RELIABLE_TRANSPORT__URL": f"{cluster.url}?request_timeout=5",
        "RELIABLE_TRANSPORT__REPLICAS": "3",
        "RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "120",  # a partition may stay without its leader a while
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(SESSION_TIMEOUT),
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": "memory://",
        "RELIABLE_COMMIT__STRATEGY": "transactional",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    }
    return ClusterRun(env, postgres_url, effects, topic, count, log_dir, failures)


def test_a_partition_leader_down_and_back_loses_and_doubles_nothing(
    mock_cluster: MockCluster, postgres_url: str, effects: str, unique: str, tmp_path: Path
) -> None:
    kafka_run(mock_cluster, postgres_url, effects, unique, 3000, tmp_path, rounds=1).run()


@pytest.mark.soak
def test_soak_partition_leaders_down_and_back(
    mock_cluster: MockCluster, postgres_url: str, effects: str, unique: str, tmp_path: Path
) -> None:
    kafka_run(mock_cluster, postgres_url, effects, unique, 20000, tmp_path, rounds=4).run()


def test_a_topic_with_another_replication_factor_is_refused(mock_cluster: MockCluster, unique: str) -> None:
    with KafkaTransport(mock_cluster.url) as transport:
        transport.publish(unique, [OutgoingMessage(b"{}")])  # auto-created: 3 replicas on 3 brokers
    with KafkaTransport(mock_cluster.url, replicas=3) as transport:
        transport.publish(unique, [OutgoingMessage(b"{}")])
    with KafkaTransport(mock_cluster.url, replicas=2) as transport, pytest.raises(
        ConfigurationError, match=rf"topic '{unique}' exists with replication factor 3 \(the settings want 2\)"
    ):
        transport.publish(unique, [OutgoingMessage(b"{}")])
