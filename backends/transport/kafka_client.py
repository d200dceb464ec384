"""The librdkafka side of `kafka://`: the URL, client settings, errors, and a waiting producer.

librdkafka reconnects by itself; what reaches the framework is an operation
that could not finish. An error librdkafka marks retriable, one saying the
brokers cannot be reached, or one of a partition without a leader or without
enough in-sync replicas (an election, a broker down) is a
`BackendUnavailableError` (the worker backs off and subscribes again; a
producer retries); any other is a `TransportError`.

With ``replicas`` set, every topic the transport uses (the cluster creates
them, with its ``default.replication.factor``) is checked when first used:
one with another replication factor is refused with a `ConfigurationError`
naming both (Kafka changes it only by a partition reassignment, an
operator's decision).
"""

from __future__ import annotations

import re
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from backends.errors import (
    BackendUnavailableError,
    ConfigurationError,
    ReliableError,
    TransportError,
)
from backends.types import text_bytes

log = structlog.get_logger(__name__)

Record = tuple[str | None, bytes, list[tuple[str, str | bytes | None]], int]
"""A record to produce: key, value, headers, timestamp in milliseconds."""

_UNREACHABLE = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._RESOLVE,
        KafkaError._WAIT_COORD,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.PREFERRED_LEADER_NOT_AVAILABLE,
        KafkaError.ELIGIBLE_LEADERS_NOT_AVAILABLE,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.KAFKA_STORAGE_ERROR,
    }
)


LOST_WITH_PARTITION = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError._DESTROY})
"""How librdkafka refuses a record for a partition its topic lost (it was deleted and created again
with fewer): unknown partition, or, for a record it held for that partition when the partition went
(a race, seen under load), its handle destroyed. Either is placed anew on a partition the topic has."""


NOT_A_MEMBER = frozenset(
    {
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.FENCED_INSTANCE_ID,
        KafkaError.STALE_MEMBER_EPOCH,
        KafkaError._ASSIGNMENT_LOST,
    }
)
"""Commit refusals saying this member no longer owns its partitions (a poll interval or session
expired, a rebalance moved them): the group's new owners read them from the last commit."""


MESSAGE_MAX_BYTES = 1_000_000
"""The producer's largest record (librdkafka's default, set so that a refusal can name it)."""


def not_a_member(exc: KafkaException) -> KafkaError | None:
    """The error of ``exc`` if it is one of `NOT_A_MEMBER`, else None."""
    error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    return error if error is not None and error.code() in NOT_A_MEMBER else None


def translate(error: KafkaError, doing: str) -> ReliableError:
    """Our error for a librdkafka ``error`` met while ``doing`` something."""
    text = f"kafka: {doing}: {error.str()} ({error.name()})"
    if error.code() == KafkaError.MSG_SIZE_TOO_LARGE:
        text += (f": a record (value, key and headers) above the producer's message.max.bytes={MESSAGE_MAX_BYTES} "
                 "or the topic's max.message.bytes")
    if error.code() in _UNREACHABLE or error.retriable():
        return BackendUnavailableError(text)
    return TransportError(text)


def raised(exc: KafkaException, doing: str) -> ReliableError:
    error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    if error is None:
        return TransportError(f"kafka: {doing}: {exc}")
    return translate(error, doing)


_OFFSET_RESET = re.compile(
    r"(?P<topic>\S+) \[(?P<queue>\d+)\]: offset reset \(at offset (?P<at>\S+)"
    r".*?\) to (?:cached )?(?:\w+ offset )?offset (?P<to>\S+)"
)


class LibrdkafkaLog:
    """librdkafka's own log lines (confluent-kafka's ``logger``) as structlog events of a group.

    An offset reset is ``transport.offset_reset`` naming the partition and both
    offsets: the offset the member was to read was out of range (retention
    deleted the records below it, or the topic was deleted and created again),
    so reading goes on from the partition's earliest offset; records between
    the two were never delivered. Any other line is ``transport.librdkafka``.
    """

    def __init__(self, group: str) -> None:
        self._group = group

    def log(self, level: int, template: str, *args: object) -> None:
        """What confluent-kafka calls with ``("%s [%s] %s", facility, client name, text)``."""
        facility, text = (str(args[0]), str(args[-1])) if len(args) == 3 else ("", template % args)
        reset = _OFFSET_RESET.search(text)
        if reset is None:
            log.log(level, "transport.librdkafka", group=self._group, facility=facility, text=text)
            return
        log.warning("transport.offset_reset", group=self._group, topic=reset["topic"], queue=int(reset["queue"]),
                    from_offset=_offset(reset["at"]), to_offset=_offset(reset["to"]), text=text)


def _offset(text: str) -> int | str:
    """An offset as librdkafka writes it: a number, or a logical one (``BEGINNING``, ``END``)."""
    return int(text) if text.lstrip("-").isdigit() else text


@dataclass(frozen=True)
class Servers:
    """The bootstrap servers of a ``kafka://host:port[,host:port]`` URL."""

    url: str
    bootstrap: str

    @classmethod
    def parse(cls, url: str) -> Servers:
        scheme, separator, rest = url.partition("://")
        location = rest.partition("?")[0]
        if scheme != "kafka" or not separator or not location:
            raise ConfigurationError(
                f"transport URL {url!r}: expected kafka://host:port[,host:port...]"
            )
        for server in location.split(","):
            host, colon, port = server.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigurationError(
                    f"transport URL {url!r}: server {server!r} is not host:port (port 1-65535)"
                )
        return cls(url, location)


def check_replicas(topic: str, wanted: int, replicas: Sequence[int]) -> None:
    """A `ConfigurationError` unless every partition of ``topic`` has ``wanted`` replicas."""
    differing = sorted(set(replicas) - {wanted})
    if differing:
        raise ConfigurationError(
            f"kafka: topic {topic!r} exists with replication factor {differing[0]} (the settings want "
            f"{wanted}); Kafka changes it only by a partition reassignment: reassign the partitions "
            "(kafka-reassign-partitions), or change [transport] replicas"
        )


class Publisher:
    """A librdkafka producer whose ``send`` returns once every record is acknowledged.

    Records go to the partition `QueueRouter` rules would pick (``crc32(key)``,
    round-robin without a key), the same as every other transport.
    """

    def __init__(self, servers: Servers, settings: dict[str, Any], timeout: float,
                 replicas: int | None = None) -> None:
        self._timeout = timeout
        self._replicas = replicas
        self._producer = Producer(
            {
                "bootstrap.servers": servers.bootstrap,
                "message.timeout.ms": int(timeout * 1000),
                "enable.idempotence": True,
                "acks": "all",
                "message.max.bytes": MESSAGE_MAX_BYTES,
                **settings,
            }
        )
        self._partitions: dict[str, int] = {}
        self._turns: dict[str, int] = {}
        self._lock = threading.Lock()

    def send(self, topic: str, records: Sequence[Record]) -> None:
        """Produce ``records`` to ``topic`` and wait until the cluster acknowledged them."""
        self.send_all({topic: records})

    def send_all(self, records: Mapping[str, Sequence[Record]], again: bool = False, *,
                 timeout: float | None = None) -> None:
        """Produce the records of each topic, then wait until the cluster acknowledged all (at
        most ``timeout`` seconds where given, else the publisher's own; records left waiting
        then may still be delivered: their ids let every consumer skip a resent copy).

        Records refused for a partition their topic no longer has (it was deleted
        and created with fewer) are sent once more, placed on the partitions it has now.
        """
        failures: list[tuple[KafkaError, str, int, Record]] = []

        def delivery(topic: str, record: Record) -> Callable[[KafkaError | None, Message], None]:
            def delivered(error: KafkaError | None, message: Message) -> None:
                if error is not None:
                    failures.append((error, topic, message.partition() or 0, record))
            return delivered

        for topic, batch in records.items():
            self._produce(topic, batch, delivery)
        doing = f"produce to {', '.join(repr(topic) for topic in records)}"
        waited = self._timeout if timeout is None else min(timeout, self._timeout)
        left = self._producer.flush(waited)
        if left:
            raise BackendUnavailableError(f"kafka: {doing}: {left} record(s) unacknowledged after {waited:g} s")
        refused = {} if again else self._placed_anew(failures)
        if sum(map(len, refused.values())) < len(failures):
            raise translate(next(error for error, topic, _, record in failures if record not in refused.get(topic, [])),
                            doing)
        if refused:
            self.send_all(refused, again=True, timeout=timeout)

    def _placed_anew(self, failures: Sequence[tuple[KafkaError, str, int, Record]]) -> dict[str, list[Record]]:
        """The records of ``failures`` refused for a partition their topic no longer has (it was
        deleted and created again with fewer: `LOST_WITH_PARTITION`)."""
        now: dict[str, int] = {}
        anew: dict[str, list[Record]] = {}
        for error, topic, partition, record in failures:
            if error.code() not in LOST_WITH_PARTITION:
                continue
            if topic not in now:
                self._changed(topic, self._known(topic))  # asks the cluster again
                now[topic] = self._known(topic)
            if partition >= now[topic]:
                anew.setdefault(topic, []).append(record)
        return anew

    def _produce(self, topic: str, records: Sequence[Record], delivery: Callable[[str, Record], Callable[..., None]]
                 ) -> None:
        try:
            for record in records:
                self._produce_one(topic, record, delivery(topic, record))
                self._producer.poll(0)
        except BufferError as exc:
            raise BackendUnavailableError(f"kafka: produce to {topic!r}: {exc}") from exc
        except KafkaException as exc:
            raise raised(exc, f"produce to {topic!r}") from exc

    def _produce_one(self, topic: str, record: Record, delivered: Callable[..., None]) -> None:
        key, value, headers, timestamp = record
        raw_key = None if key is None else text_bytes(key)  # a binary key's own bytes
        while True:
            partitions = self.partitions(topic)
            try:
                self._producer.produce(topic, value, raw_key, partition=self._partition_for(topic, raw_key, partitions),
                                       headers=headers, timestamp=timestamp, on_delivery=delivered)
                return
            except KafkaException as exc:
                error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                if error is None or error.code() != KafkaError._UNKNOWN_PARTITION or not self._changed(topic, partitions):
                    raise

    def _known(self, topic: str) -> int:
        with self._lock:
            return self._partitions.get(topic, 0)

    def _changed(self, topic: str, known: int) -> bool:
        """Whether ``topic`` has other than ``known`` partitions now: Kafka never takes partitions
        away, so fewer means the topic was deleted and created again (keys map anew)."""
        with self._lock:
            self._partitions.pop(topic, None)
        now = self.partitions(topic)
        if now != known:
            log.warning("transport.partitions_changed", topic=topic, partitions_before=known, partitions=now)
        return now != known

    def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has; asking creates it where the cluster auto-creates."""
        with self._lock:
            known = self._partitions.get(topic)
        if known is not None:
            return known
        try:
            metadata = self._producer.list_topics(topic, timeout=self._timeout)
        except KafkaException as exc:
            raise raised(exc, f"metadata of {topic!r}") from exc
        found = metadata.topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            reason = found.error.str() if found is not None and found.error else "no partitions"
            raise TransportError(
                f"kafka: topic {topic!r} is not available ({reason}); create it, "
                "or let the cluster auto-create topics"
            )
        if self._replicas is not None:
            check_replicas(topic, self._replicas, [len(partition.replicas) for partition in found.partitions.values()])
        with self._lock:
            self._partitions[topic] = len(found.partitions)
        return len(found.partitions)

    def close(self) -> None:
        self._producer.flush(self._timeout)

    def _partition_for(self, topic: str, key: bytes | None, partitions: int) -> int:
        if key is not None:
            return zlib.crc32(key) % partitions
        with self._lock:
            turn = self._turns.get(topic, 0)
            self._turns[topic] = turn + 1
        return turn % partitions
