"""The framework on `kafka://` (`tests.transports.framework`): transactional commits and kill -9 chaos.

Real PostgreSQL store; Kafka is librdkafka's mock cluster in a process of its
own (`MockCluster`), so consumer processes can be SIGKILLed while it lives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from backends.transport.kafka_mock import MockCluster
from reliable import App, Message, Settings
from tests.transports.framework import DeadLetters, FrameworkSuite
from tests.transports.kafka_place import SESSION_TIMEOUT
from tests.transports.test_kafka import produce_in_transactions, read_topic
from tests.waiting import wait_until


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
    # the session timeout: a killed worker's partitions move after it (`kafka_place.SESSION_TIMEOUT`)
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
        assert sum(committed_offsets(server.url, group, group).values()) == 203  # every message done
        saved = app.runtime.store.load_offsets(group)
        assert any(ref.topic == group for ref in saved)  # saved in the handler's transactions
        assert any(ref.topic.startswith(f"{group}-retry-{group}-") for ref in saved)  # the retry came back

    def dead_letters(self, server: MockCluster, group: str) -> DeadLetters:
        return read_topic(server, f"{group}-dlt-{group}", 2)  # the suite dead-letters two messages


def test_the_worker_commits_past_transaction_markers(cluster: MockCluster, tmp_path: Path, unique: str) -> None:
    """A contiguous watermark that waits for offsets never delivered (the markers Kafka's
    transactions leave) would commit 3 and stop there: everything after it read again on restart."""
    produce_in_transactions(cluster, unique, transactions=3, each=3)  # records 0-2 4-6 8-10, markers 3 7 11
    app = App(Settings.load(None, env={
        "RELIABLE_TRANSPORT__URL": cluster.url, "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(SESSION_TIMEOUT),
        "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}", "RELIABLE_CACHE__URL": "memory://",
        "RELIABLE_LOG__LEVEL": "warning"}))
    handled: list[int] = []

    @app.handler(unique, group=unique, token="body.token")
    def handle(message: Message, tx) -> None:
        handled.append(message.offset)

    runner = threading.Thread(target=app.run)
    runner.start()
    try:
        wait_until(lambda: committed_offsets(cluster.url, unique, unique) == {0: 11} or not runner.is_alive(),
                   "the group's committed offset to pass the markers")
    finally:
        app.stop()
        runner.join()
        app.close()
    assert handled == [0, 1, 2, 4, 5, 6, 8, 9, 10]
