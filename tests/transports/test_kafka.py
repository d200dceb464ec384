"""`kafka://` against librdkafka's mock cluster (3 brokers, the real protocol on loopback).

The cluster runs in a process of its own (`MockCluster`) for the whole
module, so a consumer process can be killed and the cluster killed apart.
Every test uses fresh topic and group names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from backends.clock import FakeClock
from backends.errors import BackendUnavailableError, ConfigurationError, TransportError
from backends.transport import open_transport
from backends.transport.base import SubscribeOptions, Subscription, origin_topic
from backends.transport.kafka import KafkaTransport
from backends.transport.kafka_layout import (
    decode_headers,
    failure_of,
    retry_topic,
    topics_read,
)
from backends.transport.kafka_mock import MockCluster
from backends.types import Failure, Message, OutgoingMessage, QueueRef
from tests.transports.kafka_place import SESSION_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 120  # fetch rounds of 0.5 s: a bound on every wait below, never reached when all is well


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as started:
        yield started


@pytest.fixture
def transport(cluster: MockCluster) -> Iterator[KafkaTransport]:
    opened = open_transport(cluster.url, visibility_timeout=SESSION_TIMEOUT)
    assert isinstance(opened, KafkaTransport)
    yield opened
    opened.close()


class Member:
    """A subscription whose assignments and revocations are recorded and can be awaited."""

    def __init__(self, transport: KafkaTransport, group: str, topic: str,
                 seek: Callable[[Sequence[QueueRef]], Mapping[QueueRef, int]] | None = None,
                 changed: threading.Condition | None = None) -> None:
        self.assigned: list[list[QueueRef]] = []
        self.revoked: list[list[QueueRef]] = []
        self.changed = changed or threading.Condition()
        self.seek = seek
        self.subscription: Subscription = transport.subscribe(
            group, [topic], SubscribeOptions(on_assign=self._on_assign, on_revoke=self._on_revoke)
        )

    def holds(self) -> set[QueueRef]:
        held: set[QueueRef] = set()
        for assigned, revoked in zip(self.assigned, [*self.revoked, []]):
            held = set(assigned) - set(revoked)
        return held if len(self.assigned) > len(self.revoked) else set()

    def _on_assign(self, queues: Sequence[QueueRef]) -> Mapping[QueueRef, int]:
        with self.changed:
            self.assigned.append(list(queues))
            self.changed.notify_all()
        return self.seek(queues) if self.seek else {}

    def _on_revoke(self, queues: Sequence[QueueRef]) -> None:
        with self.changed:
            self.revoked.append(list(queues))
            self.changed.notify_all()


def fetch_until(subscription: Subscription, count: int) -> list[Message]:
    got: list[Message] = []
    for _ in range(ROUNDS):
        if len(got) >= count:
            break
        got += subscription.fetch(count - len(got), 0.5)
    assert len(got) == count, f"got {len(got)} of {count} messages"
    return got


def fetch_nothing(subscription: Subscription, rounds: int = 4) -> None:
    for _ in range(rounds):
        assert subscription.fetch(10, 0.5) == []


def outgoing(count: int, prefix: str = "m", **fields) -> list[OutgoingMessage]:
    return [OutgoingMessage(f'{{"n":{n}}}'.encode(), message_id=f"{prefix}{n}", **fields) for n in range(count)]


def next_offsets(messages: Sequence[Message]) -> dict[QueueRef, int]:
    offsets: dict[QueueRef, int] = {}
    for m in messages:
        offsets[m.ref] = max(offsets.get(m.ref, 0), m.offset + 1)
    return offsets


def read_topic(cluster: MockCluster, topic: str, count: int) -> list[tuple[bytes, dict[str, str]]]:
    """``count`` records of ``topic``, read by a plain librdkafka consumer of a fresh group."""
    consumer = Consumer({"bootstrap.servers": cluster.url.removeprefix("kafka://"),
                         "group.id": f"reader-{os.urandom(4).hex()}", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    records = []
    try:
        for _ in range(ROUNDS):
            if len(records) >= count:
                break
            for record in consumer.consume(count, 0.5):
                if record.error() is None:
                    records.append((record.value() or b"", decode_headers(record.headers())))
    finally:
        consumer.close()
    return records


# publish, fetch, commit


def test_publish_fetch_commit_and_a_new_member_resumes_after_the_commit(
    transport: KafkaTransport, unique: str
) -> None:
    transport.publish(unique, [OutgoingMessage(b"\x00raw", key="k", headers={"h": "v"}, message_id="id-1"),
                               *outgoing(9, key="other")])
    with transport.subscribe("g", [unique]) as subscription:
        got = fetch_until(subscription, 10)
        first = next(m for m in got if m.id == "id-1")
        assert (first.topic, first.queue, first.payload, first.key, dict(first.headers), first.attempt) == (
            unique, zlib.crc32(b"k") % 4, b"\x00raw", "k", {"h": "v"}, 1)
        others = sorted(m.offset for m in got if m.key == "other")
        assert others == list(range(9))  # one key, one queue, contiguous offsets
        subscription.ack(got)
        subscription.commit(next_offsets(got))
    transport.publish(unique, outgoing(1, prefix="late"))
    with transport.subscribe("g", [unique]) as again:
        assert [m.id for m in fetch_until(again, 1)] == ["late0"]
        fetch_nothing(again, rounds=2)


def test_each_group_gets_every_message(transport: KafkaTransport, unique: str) -> None:
    transport.publish(unique, outgoing(30))
    for group in ("billing", "audit"):
        with transport.subscribe(group, [unique]) as subscription:
            assert sorted(m.id for m in fetch_until(subscription, 30)) == sorted(f"m{n}" for n in range(30))


def test_a_record_too_large_names_the_settings_that_bound_it(transport: KafkaTransport, unique: str) -> None:
    """librdkafka says only "Message size too large": the error names message.max.bytes too."""
    with pytest.raises(TransportError, match=r"MSG_SIZE_TOO_LARGE\): a record .* above the producer's "
                                             r"message.max.bytes=1000000 or the topic's max.message.bytes"):
        transport.publish(unique, [OutgoingMessage(b"x" * 1_000_001)])


def test_bad_urls_options_and_names_are_named(cluster: MockCluster, transport: KafkaTransport) -> None:
    for url in ("kafka://", "kafka://localhost", "kafka://h:99999", "kafka://h:1,nohost"):
        with pytest.raises(ConfigurationError, match="host:port"):
            open_transport(url)
    with pytest.raises(ConfigurationError, match="visibility_timeout"):
        open_transport(cluster.url, visibility_timeout=-1)
    with pytest.raises(ConfigurationError, match="unknown option"):
        open_transport(cluster.url, lease=3)
    with pytest.raises(TransportError, match="group name"):
        transport.subscribe("%bad", ["t"])
    with pytest.raises(TransportError, match="topic name"):
        transport.publish("a/b", outgoing(1))
    with pytest.raises(TransportError, match="receipt"):
        transport_subscription = transport.subscribe("g", ["t-receipts"])
        try:
            transport_subscription.ack([Message("x", "t", 0, 0, b"{}")])
        finally:
            transport_subscription.close()


# members of one group


def test_two_members_split_the_partitions_and_one_takes_all_when_the_other_leaves(
    transport: KafkaTransport, unique: str
) -> None:
    everything = {QueueRef(topic, queue) for topic in topics_read("g", unique) for queue in range(4)}
    changed = threading.Condition()
    first, second = (Member(transport, "g", unique, changed=changed) for _ in range(2))
    stops = [threading.Event(), threading.Event()]

    def poll(member: Member, stop: threading.Event) -> None:
        while not stop.is_set():
            member.subscription.fetch(10, 0.2)

    threads = [threading.Thread(target=poll, args=pair) for pair in zip((first, second), stops)]
    for thread in threads:
        thread.start()
    try:
        with changed:
            assert changed.wait_for(lambda: first.holds() and second.holds() and
                                    first.holds() | second.holds() == everything, timeout=60)
        assert not first.holds() & second.holds()
        stops[1].set()
        threads[1].join()
        second.subscription.close()
        with changed:
            assert changed.wait_for(lambda: first.holds() == everything, timeout=60)
        assert first.revoked and second.revoked  # on_revoke came before each move
    finally:
        for stop in stops:
            stop.set()
        for thread in threads:
            thread.join()
        first.subscription.close()
        second.subscription.close()


def test_on_assign_offsets_are_where_reading_starts(transport: KafkaTransport, unique: str) -> None:
    transport.publish(unique, outgoing(10, key="one"))
    queue = QueueRef(unique, zlib.crc32(b"one") % 4)
    member = Member(transport, "g", unique, seek=lambda queues: {queue: 7} if queue in queues else {})
    with member.subscription:
        assert [m.offset for m in fetch_until(member.subscription, 3)] == [7, 8, 9]
        fetch_nothing(member.subscription, rounds=2)


def produce_in_transactions(cluster: MockCluster, topic: str, transactions: int, each: int) -> None:
    """``transactions`` committed transactions of ``each`` records to partition 0 of ``topic``: each
    ends with a commit marker, an offset no consumer is ever given (0..each-1, marker, ...)."""
    producer = Producer({"bootstrap.servers": cluster.url.removeprefix("kafka://"),
                         "transactional.id": f"tx-{topic}"})
    producer.init_transactions(30)
    for t in range(transactions):
        producer.begin_transaction()
        for n in range(each):
            token = f"t{t}-{n}"
            producer.produce(topic, value=json.dumps({"token": token}).encode(), key=b"k", partition=0)
        producer.commit_transaction(30)


def test_commit_markers_between_records_do_not_hold_the_committed_offset_back(
    transport: KafkaTransport, cluster: MockCluster, unique: str
) -> None:
    produce_in_transactions(cluster, unique, transactions=2, each=3)  # records 0-2, 4-6; markers 3, 7
    with transport.subscribe("g", [unique]) as leaving:
        got = fetch_until(leaving, 6)
        assert [m.offset for m in got] == [0, 1, 2, 4, 5, 6]
        leaving.ack(got[3:])
        leaving.ack(got[:3])
    with transport.subscribe("g", [unique]) as taking_over:
        fetch_nothing(taking_over, rounds=2)  # committed on leaving past marker 3, to 7


def test_a_leaving_member_commits_its_done_prefix_and_the_next_reads_on_in_key_order(
    transport: KafkaTransport, unique: str
) -> None:
    """What the leaving member fetched and did not finish is read again from the partition, before
    the key's later messages, counted (the commit's note). Handed back through the retry topic,
    the next owner got them after the key's later messages."""
    transport.publish(unique, outgoing(20, key="one"))
    with transport.subscribe("g", [unique]) as leaving:
        got = fetch_until(leaving, 20)
        leaving.ack(got[:5])
    transport.publish(unique, outgoing(10, prefix="later", key="one"))
    with transport.subscribe("g", [unique]) as taking_over:
        again = fetch_until(taking_over, 25)
        fetch_nothing(taking_over, rounds=2)  # the acked five were committed on leaving
    assert [m.id for m in again] == [m.id for m in got[5:]] + [f"later{n}" for n in range(10)]
    assert [(m.attempt, m.topic) for m in again] == [(2, unique)] * 15 + [(1, unique)] * 10  # read again, counted


def test_a_killed_member_s_uncommitted_messages_are_read_again(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    transport.publish(unique, outgoing(40))
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.transports.test_kafka_child", cluster.url, "g", unique, "10"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    seen: list[dict] = []
    try:
        for line in child.stdout:
            if not line.startswith("{"):
                continue  # the child's own log lines
            event = json.loads(line)
            if "committed" in event:
                break
            seen.append(event)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL and len(seen) >= 10
    committed = next_offsets([Message(e["id"], unique, e["queue"], e["offset"], b"") for e in seen[:10]])
    with transport.subscribe("g", [unique]) as survivor:
        again = fetch_until(survivor, 30)
    assert sorted(m.id for m in again) == sorted({f"m{n}" for n in range(40)} - {e["id"] for e in seen[:10]})
    for m in again:
        assert m.offset >= committed.get(m.ref, 0)
        assert m.attempt == 1  # Kafka does not count a re-read after a crash


# nack, dead letters, delays, replays


def test_nack_goes_through_the_retry_topic_and_comes_back_counted_not_before_due(
    cluster: MockCluster, unique: str
) -> None:
    clock = FakeClock()
    with open_transport(cluster.url, clock, visibility_timeout=SESSION_TIMEOUT) as transport:
        transport.publish(unique, outgoing(1, headers={"h": "v"}))
        with transport.subscribe("g", [unique]) as subscription:
            (message,) = fetch_until(subscription, 1)
            subscription.nack(message, 3.0)
            subscription.commit(next_offsets([message]))
            assert read_topic(cluster, retry_topic(unique, "g", 5000), 1)  # the copy waits there
            fetch_nothing(subscription, rounds=6)  # read and held: not due on the clock
            clock.advance(3.0)
            (again,) = fetch_until(subscription, 1)
            assert (again.id, again.attempt, origin_topic(again), again.headers["h"]) == (message.id, 2, unique, "v")
            assert again.topic == retry_topic(unique, "g", 5000)
            subscription.nack(again, 0.5)
            subscription.commit(next_offsets([again]))
            clock.advance(0.5)
            (third,) = fetch_until(subscription, 1)
            assert (third.id, third.attempt, third.topic) == (message.id, 3, retry_topic(unique, "g", 1000))


def test_a_held_back_copy_keeps_its_wait_whichever_way_the_wall_clock_steps(
    cluster: MockCluster, unique: str
) -> None:
    clock = FakeClock()
    with open_transport(cluster.url, clock, visibility_timeout=SESSION_TIMEOUT) as transport:
        transport.publish(unique, outgoing(1))
        with transport.subscribe("g", [unique]) as subscription:
            (message,) = fetch_until(subscription, 1)
            subscription.nack(message, 3.0)
            subscription.commit(next_offsets([message]))
            fetch_nothing(subscription, rounds=6)  # read and held
            clock.step(3600.0)  # an NTP step, a resumed VM: not due any sooner
            fetch_nothing(subscription, rounds=6)
            clock.step(-7200.0)  # nor an hour later
            clock.advance(3.0)
            (again,) = fetch_until(subscription, 1)
            assert (again.id, again.attempt) == (message.id, 2)


def test_dead_letter_lands_on_the_group_s_dead_letter_topic_with_the_failure(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    transport.publish(unique, outgoing(1))
    failure = Failure("ValueError", "bad amount", "Traceback ...", 3, 10.0, 20.0)
    with transport.subscribe("g", [unique]) as subscription:
        (message,) = fetch_until(subscription, 1)
        subscription.dead_letter(message, failure)
    ((payload, headers),) = read_topic(cluster, f"{unique}-dlt-g", 1)
    assert payload == message.payload and failure_of(headers) == failure
    assert (headers["x-reliable-id"], headers["x-reliable-origin-topic"]) == (message.id, unique)


def test_publish_to_group_reaches_that_group_only(transport: KafkaTransport, unique: str) -> None:
    replaying, other = transport.subscribe("replaying", [unique]), transport.subscribe("other", [unique])
    with replaying, other:
        transport.publish_to_group("replaying", unique, outgoing(1, prefix="replay"))
        transport.publish(unique, outgoing(1, prefix="marker"))
        assert sorted(m.id for m in fetch_until(replaying, 2)) == ["marker0", "replay0"]
        assert [m.id for m in fetch_until(other, 1)] == ["marker0"]
        fetch_nothing(other, rounds=2)


def test_a_delayed_publish_reaches_every_group_when_due(cluster: MockCluster, unique: str) -> None:
    clock = FakeClock()
    with open_transport(cluster.url, clock, visibility_timeout=SESSION_TIMEOUT) as transport:
        transport.publish(unique, outgoing(1, prefix="later", delay=20.0))
        first, second = transport.subscribe("a", [unique]), transport.subscribe("b", [unique])
        with first, second:
            fetch_nothing(first, rounds=6)
            clock.advance(20.0)
            for subscription in (first, second):
                (message,) = fetch_until(subscription, 1)
                assert (message.id, message.attempt, origin_topic(message)) == ("later0", 1, unique)


# outages


def test_a_cluster_that_is_gone_is_unavailable() -> None:
    with MockCluster(brokers=1) as doomed:
        transport = open_transport(doomed.url, visibility_timeout=SESSION_TIMEOUT, request_timeout=2)
        subscription = transport.subscribe("g", ["gone"])
        doomed.kill()
        with pytest.raises(BackendUnavailableError, match="produce"):
            transport.publish("gone", outgoing(1))
        with pytest.raises(BackendUnavailableError, match="fetch"):
            for _ in range(ROUNDS):
                subscription.fetch(1, 0.5)
        transport.close()
