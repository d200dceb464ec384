"""`kafka://` where Kafka consumers classically go wrong: a member that lost its partitions while a
handler held their messages (a zombie), offsets the log no longer has, topics deleted under a member.

Against librdkafka's mock cluster (`MockCluster`, a process of its own, for the module); fresh topic
and group names per test.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from structlog.testing import capture_logs

from backends.errors import ConfigurationError
from backends.transport import open_transport
from backends.transport.base import SubscribeOptions, Subscription
from backends.transport.kafka import KafkaTransport
from backends.transport.kafka_client import Publisher, Servers
from backends.transport.kafka_layout import retry_topic
from backends.transport.kafka_mock import MockCluster
from backends.types import OutgoingMessage, QueueRef
from reliable import App, Message, Settings
from tests import forked
from tests.framework.refusals import Running
from tests.transports import keyed_worker
from tests.transports.effects import query, wait_until
from tests.transports.framework import without_reliable_variables
from tests.transports.kafka_place import SESSION_TIMEOUT
from tests.transports.keyed_worker import keyed_effects
from tests.transports.kill_points import JITTER, held_back, points
from tests.transports.test_kafka import ROOT, ROUNDS, fetch_until, next_offsets, outgoing

MAX_POLL_INTERVAL = 4.0
"""Seconds a batch may stay in a handler before its member leaves the group: short, so a test's
"slow handler" (a member that does not fetch) outlives it."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as started:
        yield started


@pytest.fixture
def transport(cluster: MockCluster) -> Iterator[KafkaTransport]:
    opened = open_transport(cluster.url, visibility_timeout=SESSION_TIMEOUT, max_poll_interval=MAX_POLL_INTERVAL)
    assert isinstance(opened, KafkaTransport)
    yield opened
    opened.close()


def committed(cluster: MockCluster, group: str, queue: QueueRef) -> int:
    """The offset ``group`` committed in Kafka for ``queue`` (negative: none)."""
    consumer = Consumer({"bootstrap.servers": cluster.url.removeprefix("kafka://"), "group.id": group})
    try:
        (found,) = consumer.committed([TopicPartition(queue.topic, queue.queue)], timeout=10)
    finally:
        consumer.close()
    return found.offset


def records_in(cluster: MockCluster, topic: str, partitions: int = 4) -> int:
    """How many records ``topic`` ever received (the sum of its partitions' high watermarks)."""
    consumer = Consumer({"bootstrap.servers": cluster.url.removeprefix("kafka://"), "group.id": "watermarks"})
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions))
    finally:
        consumer.close()


def fetch_until_revoked(subscription: Subscription, revoked: list[QueueRef]) -> None:
    """Fetch until the member's ``on_revoke`` (appending to ``revoked``) ran: it runs in a fetch."""
    for _ in range(ROUNDS):
        if revoked:
            return
        subscription.fetch(10, 0.5)
    raise AssertionError("the member was never told it lost its partitions")


def test_a_poll_interval_below_the_session_timeout_is_refused(cluster: MockCluster) -> None:
    with pytest.raises(ConfigurationError, match="max_poll_interval 5.0 is below visibility_timeout 10.0"):
        open_transport(f"{cluster.url}?max_poll_interval=5", visibility_timeout=10)


def test_a_member_past_its_poll_interval_commits_nothing_and_hands_nothing_back(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    """A handler slower than ``max_poll_interval`` makes its member leave the group; the next owner
    reads on from the last commit. What the zombie does with the batch it held must change nothing:
    its commit is refused by the group (logged, not raised into the worker: that ended `App.run`),
    and its revocation copies nothing to the retry topic (each copy a second delivery)."""
    transport.publish(unique, outgoing(20, key="one"))
    queue = QueueRef(unique, zlib.crc32(b"one") % 4)
    revoked: list[QueueRef] = []
    zombie = transport.subscribe("g", [unique], SubscribeOptions(on_revoke=revoked.extend))
    held = fetch_until(zombie, 20)
    zombie.ack(held[:5])
    zombie.commit({queue: 5})
    with transport.subscribe("g", [unique]) as owner:  # the zombie's handler is busy: it never fetches
        taken = fetch_until(owner, 15)  # the zombie left the group when its poll interval expired
        assert [m.offset for m in taken] == list(range(5, 20))
        owner.ack(taken)
        owner.commit({queue: 20})
        zombie.ack(held[5:10])  # the slow handler is done with five more
        zombie.commit({queue: 10})
        assert committed(cluster, "g", queue) == 20
        fetch_until_revoked(zombie, revoked)  # the zombie learns it lost the partitions when it fetches again
        zombie.close()
        assert committed(cluster, "g", queue) == 20
    assert records_in(cluster, retry_topic(unique, "g", 0)) == 0  # its ten unfinished: not copied again


def test_a_worker_whose_handler_outlived_its_poll_interval_keeps_running(
    cluster: MockCluster, transport: KafkaTransport, tmp_path: Path, unique: str
) -> None:
    """The worker's ack of the batch its slow handler finished is a commit the group refuses;
    `App.run` went down with it (a `TransportError`): a supervisor's restart, the same slow handler,
    the same end, a crash loop. Now the worker logs it, rejoins, and the group's position stays."""
    transport.publish(unique, [OutgoingMessage(json.dumps({"token": f"t{n}"}).encode(), key="one")
                               for n in range(20)])
    queue = QueueRef(unique, zlib.crc32(b"one") % 4)
    app = App(Settings.load(None, env={
        "RELIABLE_TRANSPORT__URL": f"{cluster.url}?max_poll_interval={MAX_POLL_INTERVAL}",
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(SESSION_TIMEOUT),
        "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}", "RELIABLE_CACHE__URL": "memory://",
        "RELIABLE_WORKER__PREFETCH": "5", "RELIABLE_LOG__LEVEL": "warning"}))
    started, released = threading.Event(), threading.Event()

    @app.handler(unique, group=unique, token="body.token")
    def handle(message: Message, tx) -> None:
        started.set()
        released.wait(60)  # slower than the poll interval: its member leaves the group meanwhile

    runner = threading.Thread(target=app.run)
    runner.start()
    revoked: list[QueueRef] = []
    try:
        assert started.wait(60)
        with transport.subscribe(unique, [unique], SubscribeOptions(on_revoke=revoked.extend)) as owner:
            taken = fetch_until(owner, 20)  # nothing was committed: the new owner reads it all
            owner.ack(taken)
            owner.commit({queue: 20})
            released.set()
            for _ in range(ROUNDS):  # until the worker rejoins (its owner is revoked) or its run ends
                if revoked or not runner.is_alive():
                    break
                owner.fetch(10, 0.5)
            assert runner.is_alive(), "the worker's run ended on its refused commit"
            assert revoked
    finally:
        released.set()
        app.stop()
        runner.join()
        app.close()
    assert committed(cluster, unique, queue) == 20



def test_offsets_done_out_of_order_commit_only_the_watermark_when_the_member_leaves(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    """Lanes finish a partition's messages out of order: 9 down to 1 done, 0 still running when the
    member leaves. It commits exactly the watermark, 0 (the handed-back 0 once let it commit 10), and
    the next owner reads 0-9 again from the partition, in order."""
    transport.publish(unique, outgoing(10, key="one"))
    queue = QueueRef(unique, zlib.crc32(b"one") % 4)
    with transport.subscribe(unique, [unique]) as leaving:
        got = fetch_until(leaving, 10)
        for message in reversed(got[1:]):
            leaving.ack([message])
    assert committed(cluster, unique, queue) == 0
    with transport.subscribe(unique, [unique]) as taking_over:
        assert [(m.topic, m.offset) for m in fetch_until(taking_over, 10)] == [(unique, n) for n in range(10)]



def test_messages_left_unfinished_twice_are_read_again_counted_twice(transport: KafkaTransport, unique: str) -> None:
    """Each leaving member commits a note with its done prefix (the commit's metadata): the offsets
    it left unfinished were delivered once more. Notes add up across owners."""
    transport.publish(unique, outgoing(6, key="one"))
    for finished in (2, 1):  # the first finishes 0-1, the second 2 only
        with transport.subscribe(unique, [unique]) as leaving:
            got = fetch_until(leaving, 6 - (2 if finished == 1 else 0))
            leaving.ack(got[:finished])
    with transport.subscribe(unique, [unique]) as last:
        assert [(m.offset, m.attempt) for m in fetch_until(last, 3)] == [(3, 3), (4, 3), (5, 3)]


def test_a_commit_refused_in_the_revoke_callback_moves_nothing_and_the_next_owner_skips_nothing(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    """A second member joins: the first one's commit of its done prefix in its revoke callback is
    refused (the mock takes no commit while the group's members join again, REBALANCE_IN_PROGRESS; a
    real cluster takes it then, and refuses it once the member's generation is gone). Refused inside librdkafka's
    callback, it is logged, not raised out of the fetch that ran the callback; the group's offset stays
    at the last commit it took, and the partition's next owner reads on from there: the done but
    uncommitted messages come again (the tokens skip them), none after them is skipped."""
    transport.publish(unique, outgoing(20, key="one"))
    queue = QueueRef(unique, zlib.crc32(b"one") % 4)
    first = transport.subscribe(unique, [unique])
    held = fetch_until(first, 20)
    first.ack(held[:5])
    first.commit({queue: 5})
    first.ack(held[5:10])  # done, not committed yet: the revoke callback commits it
    read: dict[int, list[int]] = {0: [], 1: []}  # per member, the offsets of ``queue`` it read
    with capture_logs() as logs:
        second = transport.subscribe(unique, [unique])
        for _ in range(ROUNDS * 5):  # until the partition's owner after the rebalance read it to its end
            if any(offsets[-15:] == list(range(5, 20)) for offsets in read.values()):
                break
            for n, member in enumerate((first, second)):  # short fetches: each serves its callbacks often
                read[n] += [m.offset for m in member.fetch(20, 0.1) if m.ref == queue]
    first.close()
    second.close()
    events = [e["event"] for e in logs]
    refused = [e for e in logs if e["event"] == "transport.commit_refused"]
    assert refused, "no commit refused (as not a member's) in the revoke callback"
    # the group rebalancing, or (the first member late to join again) at a generation it left
    assert refused[0]["code"] in {"REBALANCE_IN_PROGRESS", "ILLEGAL_GENERATION"}
    assert refused[0]["offsets"] == {str(queue): 10}
    assert events.index("transport.commit_refused") < events.index("transport.revoked")  # in the callback
    assert committed(cluster, unique, queue) == 5  # the refused commit moved nothing
    assert min(read[0] + read[1]) == 5  # read on from the last commit taken, nothing after it skipped
    assert any(offsets[-15:] == list(range(5, 20)) for offsets in read.values())


# offsets the log no longer has


def commit_as_a_dead_member(cluster: MockCluster, group: str, queue: QueueRef, offset: int) -> None:
    """What a member killed after committing ``offset`` leaves behind: the commit alone."""
    consumer = Consumer({"bootstrap.servers": cluster.url.removeprefix("kafka://"), "group.id": group})
    try:
        consumer.commit(offsets=[TopicPartition(queue.topic, queue.queue, offset)], asynchronous=False)
    finally:
        consumer.close()


def test_a_committed_offset_retention_deleted_is_reset_with_a_log_line_naming_both_offsets(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    """Retention deleted offsets 5-14 before the group read them: they are gone, and reading goes on
    at 15. That was said only by librdkafka's own line on stderr, outside the structured log."""
    transport.publish(unique, outgoing(20, key="one"))
    queue = QueueRef(unique, zlib.crc32(b"one") % 4)
    commit_as_a_dead_member(cluster, unique, queue, 5)
    cluster.delete_records(unique, queue.queue, 15)
    with capture_logs() as logs, transport.subscribe(unique, [unique]) as member:
        assert [m.offset for m in fetch_until(member, 5)] == [15, 16, 17, 18, 19]
    resets = [(e["topic"], e["queue"], e["from_offset"], e["to_offset"])
              for e in logs if e["event"] == "transport.offset_reset"]
    assert resets == [(unique, queue.queue, 5, 15)]


# topics deleted and created again


def test_a_topic_created_again_with_fewer_partitions_takes_publishes(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    """The publisher knew 4 partitions; keys of partitions 2 and 3 were refused (`TransportError`,
    unknown partition) on every publish until the process restarted."""
    keys = [f"k{n}" for n in range(20)]
    assert {zlib.crc32(k.encode()) % 4 for k in keys} == {0, 1, 2, 3}
    transport.publish(unique, [OutgoingMessage(b"{}", key=k, message_id=f"before-{k}") for k in keys])
    cluster.delete_topic(unique)
    cluster.create_topic(unique, 2)
    with capture_logs() as logs:
        transport.publish(unique, [OutgoingMessage(b"{}", key=k, message_id=f"after-{k}") for k in keys])
    assert [(e["partitions_before"], e["partitions"]) for e in logs
            if e["event"] == "transport.partitions_changed"] == [(4, 2)]
    with transport.subscribe(unique, [unique]) as member:
        got = fetch_until(member, 20)
    assert sorted(m.id for m in got) == sorted(f"after-{k}" for k in keys)
    assert {(m.key, m.queue) for m in got} == {(k, zlib.crc32(k.encode()) % 2) for k in keys}


def test_records_librdkafka_dropped_with_a_partition_the_topic_lost_are_placed_anew(
    cluster: MockCluster, unique: str
) -> None:
    """Under load librdkafka refused records it held for a partition the topic lost with _DESTROY
    rather than _UNKNOWN_PARTITION (1 of 20 runs of the tests here, 10 records of 40 in 1 of 40
    re-creations of a raw producer): the publish failed. The race itself cannot be ordered from
    here: these are the refusals librdkafka gave, on the topic created again with 2 partitions."""
    publisher = Publisher(Servers.parse(cluster.url), {}, 10.0)
    publisher.send(unique, [(None, b"{}", [], 0)])  # it knows 4 partitions
    cluster.delete_topic(unique)
    cluster.create_topic(unique, 2)
    lost, kept, other = [(None, f"{n}".encode(), [], 0) for n in range(3)]
    refused = [(KafkaError(KafkaError._DESTROY), unique, 3, lost),
               (KafkaError(KafkaError._DESTROY), unique, 1, kept),  # on a partition it has: not ours to resend
               (KafkaError(KafkaError._MSG_TIMED_OUT), unique, 2, other)]
    with capture_logs() as logs:
        assert publisher._placed_anew(refused) == {unique: [lost]}
    assert [(e["partitions_before"], e["partitions"]) for e in logs] == [(4, 2)]
    publisher.close()


def test_a_member_reading_a_topic_created_again_reads_the_new_log_from_its_start(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    """The member held positions 4-6 of the old log's partitions; the new log's first records there
    were skipped without a word (30 of 40 delivered)."""
    transport.publish(unique, outgoing(20, prefix="old", key=None))
    with capture_logs() as logs, transport.subscribe(unique, [unique]) as member:
        old = fetch_until(member, 20)
        member.ack(old)
        member.commit(next_offsets(old))
        cluster.delete_topic(unique)
        cluster.create_topic(unique, 2)
        transport.publish(unique, outgoing(40, prefix="new", key=None))
        expected = {f"new{n}" for n in range(40)}
        seen: set[str] = set()
        for _ in range(ROUNDS):  # records read before the member saw the re-creation come again: tokens skip them
            if seen >= expected:
                break
            seen.update(m.id for m in member.fetch(40, 0.5))
    assert seen == expected
    # told after a fetch (the partitions read again) or at the rebalance librdkafka starts (none: they move)
    recreated = [(e["topic"], e["gone"]) for e in logs if e["event"] == "transport.topic_recreated"]
    assert recreated == [(unique, [2, 3])]


@pytest.mark.parametrize("partitions", [4, 6])
def test_a_member_leaving_a_topic_created_again_commits_nothing_of_the_old_log(
    cluster: MockCluster, transport: KafkaTransport, unique: str, partitions: int
) -> None:
    """The leaving member committed its done prefix of the old log (3 of each partition) to the new
    one, whose offsets the cluster had deleted with the topic: the next member skipped the new log's
    first 3 records of every partition (28 of 40 delivered)."""
    transport.publish(unique, outgoing(20, prefix="old", key=None))
    with capture_logs() as logs:
        with transport.subscribe(unique, [unique]) as leaving:
            old = fetch_until(leaving, 20)
            leaving.ack([m for m in old if m.offset < 3])
            cluster.delete_topic(unique)
            cluster.create_topic(unique, partitions)
            transport.publish(unique, outgoing(40, prefix="new", key=None))
        with transport.subscribe(unique, [unique]) as member:
            new = fetch_until(member, 40)
    assert sorted(m.id for m in new) == sorted(f"new{n}" for n in range(40))
    assert {m.attempt for m in new} == {1}
    assert [(e["topic"], e["positions"]) for e in logs if e["event"] == "transport.topic_recreated"] == [
        (unique, {str(QueueRef(unique, queue)): 3 for queue in range(4)})
    ]


# two members, one killed again and again


KEYS = 40
STOPS = (signal.SIGKILL, signal.SIGTERM)
"""How a worker is stopped, in turn: killed, or asked to stop (it leaves its batch's rest unfinished)."""


@pytest.mark.parametrize("strategy", ["per_message", "transactional"])
def test_two_members_one_killed_at_random_each_effect_once_in_key_order(
    cluster: MockCluster, postgres_url: str, unique: str, strategy: str
) -> None:
    """2,000 keyed messages published while two workers of one group consume them and one of
    them, either, is killed (SIGKILL) or stopped (SIGTERM: the rest of its batch left unfinished)
    and started again, eight times: its partitions move to the other and back (eager rebalances,
    the done prefix committed by lanes finishing out of order). Every effect once; each key's
    effects in the order of its messages (Kafka keeps a key in one partition, read in order by
    one member)."""
    query(postgres_url, f"create table {unique} (id bigserial primary key, token text unique, key text, n int, pid int)")
    env = {**without_reliable_variables(), "PYTHONPATH": str(ROOT),
           "RELIABLE_TRANSPORT__URL": cluster.url, "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(SESSION_TIMEOUT),
           "RELIABLE_STORE__URL": postgres_url, "RELIABLE_CACHE__URL": "memory://",
           "RELIABLE_COMMIT__STRATEGY": strategy, "RELIABLE_LOG__LEVEL": "warning"}
    per_key = 2_000 // KEYS
    messages = [OutgoingMessage(json.dumps({"token": f"k{k}-{n}", "n": n}).encode(), key=f"k{k}")
                for n in range(per_key) for k in range(KEYS)]
    head, tail = held_back(messages)  # the tail published only after the last stop: no stop after the work
    producer = open_transport(cluster.url)

    def send(part: Sequence[OutgoingMessage]) -> None:
        for i in range(0, len(part), 100):
            producer.publish(unique, part[i:i + 100])

    def start() -> BaseProcess:
        return forked.start(keyed_worker.main, (unique, unique, unique), env, ROOT)

    def done(worker: BaseProcess | None = None) -> int:  # the effects written (by ``worker``)
        mine = f" where pid = {worker.pid}" if worker else ""
        return int(query(postgres_url, f"select count(*) from {unique}{mine}")[0][0])

    def working() -> list[int]:  # the workers whose own effects moved since they were last seen
        return [i for i, worker in enumerate(workers) if done(worker) > seen[i]]

    sending = threading.Thread(target=send, args=(head,))
    rng, workers, seen = random.Random(), [start(), start()], [0, 0]  # seen: each one's effects when last seen
    landed: list[tuple[int, int]] = []  # per stop: the victim's own effects and all, after it
    sending.start()
    try:
        for round, point in enumerate(points(8, len(head), rng)):
            wait_until(lambda: done() >= point and bool(working()),  # noqa: B023
                       lambda: all(w.is_alive() for w in workers), 0.05)
            victim, stop = rng.choice(working()), STOPS[round % 2]  # one at work, at a random moment
            time.sleep(rng.uniform(0, JITTER))
            os.kill(workers[victim].pid or 0, stop)
            workers[victim].join(timeout=60)
            assert workers[victim].exitcode == (-signal.SIGKILL if stop == signal.SIGKILL else 0)
            landed.append((done(workers[victim]), done()))  # at least what they were at the stop
            workers[victim] = start()
            seen = [0 if i == victim else done(worker) for i, worker in enumerate(workers)]
        sending.join()
        send(tail)  # only now can the work end
        wait_until(lambda: done() >= len(messages), lambda: all(w.is_alive() for w in workers))
    finally:
        sending.join()
        producer.close()
        for worker in workers:
            worker.kill()
            worker.join(timeout=30)
        effects = keyed_effects(postgres_url, unique)
        query(postgres_url, f"drop table {unique}")
    assert len(landed) == 8 and all(own and n < len(messages) for own, n in landed), \
        "the kills landed while messages were being processed, each after some work of its victim's"
    print(f"two members {strategy}: 8 stops at progress {[n for _, n in landed]} of {len(messages)}")
    assert sorted(effects) == sorted(f"k{k}" for k in range(KEYS))
    assert {key: numbers for key, numbers in effects.items() if numbers != list(range(per_key))} == {}


def test_a_member_frozen_past_its_session_commits_nothing_once_thawed(
    cluster: MockCluster, transport: KafkaTransport, unique: str
) -> None:
    """A process stopped longer than its session (a GC pause, a frozen VM) holds a batch whose
    partitions moved meanwhile. Thawed, its commit is refused by the group: returned (logged), not
    raised into its worker, and the new owner's committed offset stays."""
    transport.publish(unique, outgoing(20, key="one"))
    queue = QueueRef(unique, zlib.crc32(b"one") % 4)
    child = subprocess.Popen([sys.executable, "-m", "tests.transports.kafka_frozen_member", cluster.url, unique,
                              unique, "20"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert json.loads(next(line for line in child.stdout if line.startswith("{"))) == {"fetched": 20}
        child.send_signal(signal.SIGSTOP)
        with transport.subscribe(unique, [unique]) as owner:
            taken = fetch_until(owner, 20)  # the frozen member's session expired: nothing was committed
            owner.ack(taken)
            owner.commit({queue: 20})
            child.send_signal(signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            thawed = json.loads(next(line for line in child.stdout if line.startswith("{")))
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()
    assert thawed == {"commit": "returned", "told": True}
    assert committed(cluster, unique, queue) == 20


def test_a_commit_refused_for_a_topic_deleted_under_a_worker_leaves_the_group_and_goes_on(
    cluster: MockCluster, tmp_path: Path, unique: str
) -> None:
    """The topic deleted while a handler holds its message: the commit of its offset is refused
    (``UNKNOWN_TOPIC_OR_PART``), and the old worker's ``run()`` ended with it. The effect is
    committed with its token; the worker logs the refusal once, joins again and goes on."""
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": cluster.url,
                                       "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(SESSION_TIMEOUT)}))
    done: list[int] = []
    held: list[str] = []

    @app.handler(unique, group=unique)
    def handle(msg: Message, tx: object) -> None:
        if not held:
            held.append(msg.id)
            cluster.delete_topic(unique)  # what the commit after this handler meets
        done.append(msg.body["n"])

    def create_again(_logger: object, _method: str, event: dict) -> dict:
        """Once the refusal is logged, before the worker joins again: a member subscribed to a topic
        that does not exist sees it created only at librdkafka's metadata refresh (5 minutes)."""
        if event["event"] == "transport_settle_refused":
            cluster.create_topic(unique, 2)
        return event

    app.publish(unique, {"n": 1})
    with capture_logs(processors=[create_again]) as logs:
        run = Running(app)
        wait_until(lambda: any(e["event"] == "transport_settle_refused" for e in logs), lambda: run.error is None)
        app.publish(unique, {"n": 2})
        wait_until(lambda: 2 in done, lambda: run.error is None)
        assert run.thread.is_alive()
        app.stop()
        run.join()
    assert run.error is None, run.error
    assert done == [1, 2]
    (refused,) = [e for e in logs if e.get("settling") is not None]
    assert refused["event"] == "transport_settle_refused" and refused["settling"] == "commit"
    assert refused["messages"] == held and "UNKNOWN_TOPIC_OR_PART" in refused["error"]
    app.close()
