"""Topics deleted and created again under a member, told apart by Kafka's topic ids.

A topic deleted and created again starts its offsets over, while a member
reading it still holds positions of the old log: librdkafka's fetch
positions, and the done prefix the member would commit. Read on from them,
the new log's first records are skipped without a word; committed (the
cluster deleted the group's offsets with the topic), they are skipped for
every later owner too. Which partitions a topic has cannot tell the two logs
apart; Kafka names each life of a topic with a topic id (KIP-516). A member
notes the ids of the topics it reads when it subscribes and looks again
where its positions could cross from one life to the next: after librdkafka
reported a partition or topic it does not know (`TopicLives.hear`, then
`TopicLives.found`), and before it commits the partitions it gives up (a
rebalance, which librdkafka starts when a topic's partition count changes,
or leaving the group: `TopicLives.recreated`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

import structlog
from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient

from backends.errors import ReliableError
from backends.transport.kafka_client import raised
from backends.types import QueueRef

log = structlog.get_logger(__name__)

UNKNOWN = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART})
"""librdkafka's errors for a partition or topic it no longer knows: the topic may have been deleted
(and created again, with fewer partitions)."""


class TopicLives:
    """The topic id of each topic a member reads, and which topics were created again since."""

    def __init__(self, bootstrap: str, topics: Sequence[str], timeout: float) -> None:
        self._admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": int(timeout * 1000)})
        self._timeout = timeout
        self._lock = threading.Lock()
        self._ids = {topic: topic_id for topic, (topic_id, _) in self._describe(topics).items()}
        self._heard = False

    def hear(self, error: KafkaError) -> None:
        """An error librdkafka reported (in its callback, where it must not be called back): one of
        `UNKNOWN` makes the next `found` look at the cluster."""
        if error.code() in UNKNOWN:
            with self._lock:
                self._heard = True

    def found(self) -> dict[str, int]:
        """The topics read that were created again, with their partition counts, if librdkafka
        reported an unknown partition or topic since the last call; else none, without asking."""
        with self._lock:
            heard, self._heard = self._heard, False
        if not heard:
            return {}
        try:
            return self.recreated(list(self._ids))
        except ReliableError:
            with self._lock:
                self._heard = True  # asked again on the next call
            raise

    def recreated(self, topics: Iterable[str]) -> dict[str, int]:
        """Of ``topics``, those whose topic id changed since noted, with their partition counts; the
        new ids are noted. A topic deleted and not created again yet is not among them."""
        lives = self._describe(sorted(set(topics)))
        changed: dict[str, int] = {}
        with self._lock:
            for topic, (topic_id, partitions) in lives.items():
                if self._ids.setdefault(topic, topic_id) != topic_id:
                    self._ids[topic] = topic_id
                    changed[topic] = partitions
        return changed

    def _describe(self, topics: Sequence[str]) -> dict[str, tuple[str, int]]:
        """The topic id and partition count of each of ``topics`` the cluster has."""
        if not topics:
            return {}
        try:
            futures = self._admin.describe_topics(TopicCollection(list(topics)), request_timeout=self._timeout)
        except KafkaException as exc:
            raise raised(exc, f"topic ids of {', '.join(topics)}") from exc
        lives: dict[str, tuple[str, int]] = {}
        for topic, future in futures.items():
            try:
                description = future.result()
            except KafkaException as exc:
                if exc.args and isinstance(exc.args[0], KafkaError) and exc.args[0].code() in UNKNOWN:
                    continue  # deleted: no log to read
                raise raised(exc, f"topic id of {topic!r}") from exc
            lives[topic] = (str(description.topic_id), len(description.partitions))
        return lives


def log_recreated(group: str, topic: str, gone: Sequence[QueueRef], read_again: Sequence[QueueRef],
                  positions: Mapping[QueueRef, int]) -> None:
    """``transport.topic_recreated``: the member's partitions of ``topic`` the new log lacks
    (``gone``), those it reads from their beginning (``read_again``), the old positions dropped."""
    log.warning("transport.topic_recreated", group=group, topic=topic, gone=[ref.queue for ref in gone],
                read_again=[ref.queue for ref in read_again],
                positions={str(ref): offset for ref, offset in sorted(positions.items())})
