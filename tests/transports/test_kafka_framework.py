"""The framework on `kafka://` (`tests.transports.framework`): transactional commits and kill -9 chaos.

Real PostgreSQL store; Kafka is librdkafka's mock cluster in a process of its
own (`MockCluster`), so consumer processes can be SIGKILLed while it lives.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, TopicPartition

from backends.transport.kafka_mock import MockCluster
from reliable import App
from tests.transports.framework import DeadLetters, FrameworkSuite
from tests.transports.kafka_place import SESSION_TIMEOUT
from tests.transports.test_kafka import read_topic


def committed_offsets(url: str, group: str, topic: str) -> dict[int, int]:
    """The offsets ``group`` committed in Kafka for the partitions of ``topic``."""
    consumer = Consumer({"bootstrap.servers": url.removeprefix("kafka://"), "group.id": group})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in found if tp.offset >= 0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as started:
        yield started


class TestKafkaFramework(FrameworkSuite):
    visibility_timeout = SESSION_TIMEOUT

    @pytest.fixture
    def server(self, cluster: MockCluster) -> MockCluster:
        return cluster

    @pytest.fixture
    def place(self, server: MockCluster) -> str:
        return server.url  # topics and groups are fresh per test already

    @pytest.fixture
    def cache_url(self) -> str:
        return "memory://"

    def check_acked(self, server: MockCluster, app: App, group: str, flaky_attempts: list[int]) -> None:
        assert flaky_attempts[0] == 1
        assert sum(committed_offsets(server.url, group, group).values()) == 202  # every message done
        saved = app.runtime.store.load_offsets(group)
        assert any(ref.topic == group for ref in saved)  # saved in the handler's transactions
        assert any(ref.topic.startswith(f"{group}-retry-{group}-") for ref in saved)  # the retry came back

    def dead_letters(self, server: MockCluster, group: str) -> DeadLetters:
        return read_topic(server, f"{group}-dlt-{group}", 1)
