"""What a RabbitMQ server does to a running ``amqp://`` worker and to ``app.publish``.

The worker's queue deleted under it (``rabbitmqctl delete_queue``, or ``queue.delete`` from
another client): RabbitMQ cancels the consumer, and the old worker waited for ever on a queue
that was gone, saying nothing, while a publisher declared it anew and filled it.

A memory or disk alarm (``set_vm_memory_high_watermark``, ``set_disk_free_limit``) on a node of the test's own: RabbitMQ blocks
a connection once it publishes; pika closed it after its blocked-connection timeout, and the
error said only "Blocked connection timeout expired.". It now names the block and RabbitMQ's
reason, a publish gives up by its ``publish_timeout``, and a member's blocked retry copy waits
for the alarm's end without closing the member's connection. Real RabbitMQ.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pika
import pytest
from structlog.testing import capture_logs

from backends.errors import BackendUnavailableError
from backends.transport.amqp_layout import BUCKETS_MS, Layout
from backends.transport.amqp_transport import AmqpTransport
from reliable import App, Message
from reliable.settings import Settings
from tests.cluster.rabbit_cluster import RabbitCluster
from tests.framework.refusals import Running
from tests.transports.test_amqp import queue_length
from tests.waiting import wait_until


def worker_app(folder: Path, url: str, done: list[int], **env: str) -> App:
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{folder / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": url, **env}))

    @app.handler("orders", group="shipping")
    def ship(msg: Message, tx: object) -> None:
        done.append(msg.body["n"])

    return app


@pytest.fixture
def namespace(amqp_url: str, unique: str) -> Iterator[str]:
    """A namespace of the test's own on the shared RabbitMQ; its queues deleted afterwards."""
    yield unique
    with AmqpTransport(amqp_url, namespace=unique) as transport:
        transport.declare("shipping", ["orders"])  # so that purge knows the group's queues
        transport.purge()


def queue_exists(amqp_url: str, queue: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        connection.channel().queue_declare(queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker:
        return False
    finally:
        connection.close()


def test_a_worker_whose_queue_is_deleted_declares_it_again_and_goes_on(
    tmp_path: Path, amqp_url: str, namespace: str
) -> None:
    done: list[int] = []
    app = worker_app(tmp_path, f"{amqp_url}?namespace={namespace}", done)
    queue = Layout(namespace).queue("orders", "shipping")
    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"n": 1})
        wait_until(lambda: done == [1], "the first message handled")
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        connection.channel().queue_delete(queue)
        connection.close()
        wait_until(lambda: queue_exists(amqp_url, queue), "the worker to declare its queue again")
        app.publish("orders", {"n": 2})
        wait_until(lambda: done == [1, 2], "the message published after the deletion handled")
        app.stop()
        run.join()
    assert run.error is None, run.error
    (left,) = [e for e in logs if e["event"] == "transport_unavailable"]
    assert f"cancelled the consumer of group 'shipping' on queue {queue!r}" in left["error"]
    assert "deleted" in left["error"]
    app.close()


@pytest.fixture(scope="module")
def own_rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RabbitCluster, str]]:
    """A RabbitMQ node of the module's own: an alarm on the shared one would stop every other test.
    The tests that use it run on one worker (``tests/scheduling.py``), so one node serves them."""
    with RabbitCluster(tmp_path_factory.mktemp("rabbit"), f"alarm{uuid.uuid4().hex[:8]}", size=1) as node:
        node.ctl(node.nodes[0], "await_startup")
        yield node, node.nodes[0]


ALARMS = {  # rabbitmqctl's command, the value that raises the alarm, the value that clears it
    "memory": ("set_vm_memory_high_watermark", "0.0000001", "0.4"),
    "disk": ("set_disk_free_limit", "100000GB", "50MB"),
}


@contextmanager
def resource_alarm(cluster: RabbitCluster, node: str, kind: str = "memory") -> Iterator[None]:
    """RabbitMQ blocking every connection that publishes, as when it runs low on memory or disk."""
    command, raised, cleared = ALARMS[kind]

    def alarms() -> str:
        return cluster.ctl(node, "eval", "rabbit_alarm:get_alarms().")

    cluster.ctl(node, command, raised)
    try:
        wait_until(lambda: kind in alarms(), f"the {kind} alarm")
        yield
    finally:
        cluster.ctl(node, command, cleared)
        wait_until(lambda: kind not in alarms(), f"the {kind} alarm to clear")


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_publish_under_a_resource_alarm_names_it_and_goes_through_once_it_clears(
    tmp_path: Path, own_rabbit: tuple[RabbitCluster, str], kind: str
) -> None:
    cluster, node = own_rabbit
    done: list[int] = []
    app = worker_app(tmp_path, f"{cluster.url(node)}?connect_timeout=1", done,  # blocked 3 s at most
                     RELIABLE_TRANSPORT__PUBLISH_TIMEOUT="1")
    app.publish("orders", {"n": 1})
    with resource_alarm(cluster, node, kind), capture_logs() as logs:
        with pytest.raises(BackendUnavailableError, match=rf"RabbitMQ blocked publishing on this connection "
                                                          rf"\(low on {kind}\).*memory or disk alarm"):
            app.publish("orders", {"n": 2})  # the old error: "Blocked connection timeout expired."
    assert any(e["event"] == "transport.publishing_blocked" and e["reason"] == f"low on {kind}" for e in logs)
    app.publish("orders", {"n": 3})
    app.run(until_idle=True)
    # a publish that raised may still have reached the queue (RabbitMQ had read it before it stopped
    # reading): raised means "publish again", never "lost" nor "sent"
    assert done in ([1, 3], [1, 2, 3])
    app.close()


def test_a_publish_under_an_alarm_gives_up_by_publish_timeout_naming_the_alarm(
    tmp_path: Path, own_rabbit: tuple[RabbitCluster, str], unique: str
) -> None:
    """The old publish waited out pika's blocked-connection timeout (3 x connect_timeout: here
    30 minutes) whatever ``publish_timeout`` said."""
    cluster, node = own_rabbit
    app = worker_app(tmp_path, f"{cluster.url(node)}?connect_timeout=600&namespace={unique}", [],
                     RELIABLE_TRANSPORT__PUBLISH_TIMEOUT="3")
    app.publish("orders", {"n": 1})
    raised: list[BaseException] = []

    def publish() -> None:
        try:
            app.publish("orders", {"n": 2})
        except BackendUnavailableError as exc:
            raised.append(exc)

    with resource_alarm(cluster, node):
        publishing = threading.Thread(target=publish, daemon=True)
        publishing.start()
        wait_until(lambda: raised, "the publish to give up by its publish_timeout")
    publishing.join()
    assert "RabbitMQ blocked publishing on this connection (low on memory)" in str(raised[0])
    assert "memory or disk alarm" in str(raised[0])
    app.publish("orders", {"n": 3})
    # 1, 3, and 2 at most once: RabbitMQ enqueues the publish it read as it blocked the connection,
    # which then sends nothing more; a new connection per retry had each retry enqueued as well
    assert queue_length(cluster.url(node), Layout(unique).queue("orders", "shipping")) <= 3
    app.close()


def test_a_long_alarm_costs_a_retrying_message_none_of_its_redeliveries(
    tmp_path: Path, own_rabbit: tuple[RabbitCluster, str]
) -> None:
    """The old worker: each blocked retry copy closed the member's connection after pika's
    blocked-connection timeout, RabbitMQ counted the message it held as delivered again, and an
    alarm longer than ``max_redeliveries`` such timeouts dead-lettered a message whose handler
    failed only for want of the alarm's end (here attempts 1, 2, 3 for a message retried once)."""
    cluster, node = own_rabbit
    alarm_on, attempts = threading.Event(), []
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": f"{cluster.url(node)}?connect_timeout=1",
                                       "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
                                       "RELIABLE_RETRY__MAX_REDELIVERIES": "2",
                                       "RELIABLE_RETRY__INITIAL_DELAY": "0.1"}))

    @app.handler("payments", group="billing")
    def bill(msg: Message, tx: object) -> None:
        attempts.append(msg.attempt)
        if len(attempts) == 1:
            alarm_on.wait(60)
        if alarm_on.is_set():
            raise ConnectionError("the bank is down")  # its retry copy meets the alarm

    app.publish("payments", {"n": 1})
    with capture_logs() as logs:
        run = Running(app)
        wait_until(lambda: attempts, "the first attempt")
        with resource_alarm(cluster, node):
            alarm_on.set()
            wait_until(lambda: sum(e["event"] == "transport.publishing_blocked" for e in logs) >= 2 or run.error,
                       "the retry copy blocked twice")
            held_from = time.monotonic()  # the alarm outlasts pika's blocked-connection timeout (3 s) 4 times
            wait_until(lambda: time.monotonic() - held_from > 4 * 3, "the alarm held for 4 blocked timeouts")
            alarm_on.clear()
        wait_until(lambda: app.stats()["processed"] + app.stats()["dead_lettered"] or run.error,
                   "the message handled or dead-lettered")
        app.stop()
        run.join()
    assert run.error is None, run.error
    assert app.stats()["dead_lettered"] == 0 and app.stats()["processed"] == 1
    assert attempts == [1, 2]  # the retry after the alarm is the message's second delivery
    refused = next(e for e in logs if e["event"] == "transport_writes_refused")
    assert "RabbitMQ blocked publishing on this connection (low on memory)" in refused["error"]
    assert not any(e["event"] == "transport_unavailable" for e in logs)  # the member kept its place
    app.close()


def test_a_dead_letter_copy_blocked_by_an_alarm_waits_for_its_end_and_is_sent_once(
    tmp_path: Path, own_rabbit: tuple[RabbitCluster, str], unique: str
) -> None:
    """The old worker left its group at each blocked dead-letter copy: the message came back and
    its handler ran again (attempts 1, 2, ...) until the alarm ended."""
    cluster, node = own_rabbit
    alarm_on, attempts = threading.Event(), []
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL":
                                           f"{cluster.url(node)}?connect_timeout=1&namespace={unique}"}))

    @app.handler("refunds", group="audit", fatal=[KeyError])
    def audit(msg: Message, tx: object) -> None:
        attempts.append(msg.attempt)
        alarm_on.wait(60)
        raise KeyError("never")  # its dead-letter copy meets the alarm

    app.publish("refunds", {"n": 1})
    with capture_logs() as logs, resource_alarm(cluster, node, "disk"):
        run = Running(app)
        wait_until(lambda: attempts, "the first attempt")
        alarm_on.set()
        wait_until(lambda: sum(e["event"] == "transport.publishing_blocked" for e in logs) >= 2 or run.error,
                   "the dead-letter copy blocked twice")
    layout, url = Layout(unique), cluster.url(node)
    work = layout.queue("refunds", "audit")

    def paid() -> bool:  # the member acks the original once RabbitMQ confirmed its owed copy
        listed = cluster.ctl(node, "list_queues", "-q", "name", "messages_unacknowledged")
        return any(line.split() == [work, "0"] for line in listed.splitlines())

    wait_until(lambda: paid() or run.error, "the owed dead-letter copy sent")
    app.stop()
    run.join()
    assert run.error is None, run.error
    assert attempts == [1]  # held, never handed back
    # a blocked publish may have been enqueued too: a copy more, never none
    assert queue_length(url, layout.dead_letter_queue("audit")) >= 1
    assert queue_length(url, work) == 0  # the original acked, not returned
    refused = next(e for e in logs if e["event"] == "transport_writes_refused")
    assert "RabbitMQ blocked publishing on this connection (low on disk)" in refused["error"]
    app.close()


@pytest.mark.parametrize("deleted", ["delay queues", "dead-letter queue"])
def test_a_retry_or_dead_letter_queue_deleted_under_a_worker_is_declared_again(
    tmp_path: Path, amqp_url: str, namespace: str, deleted: str
) -> None:
    """The old worker: a retry copy to a deleted delay queue ended ``run()`` with "had no queue to
    take the message"; with the dead-letter queue deleted, every later copy was refused for good."""
    attempts: list[tuple[int, int]] = []
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": f"{amqp_url}?namespace={namespace}",
                                       "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
                                       "RELIABLE_RETRY__INITIAL_DELAY": "0.3"}))

    @app.handler("orders", group="shipping", fatal=[KeyError])
    def ship(msg: Message, tx: object) -> None:
        attempts.append((msg.body["n"], msg.attempt))
        if msg.body["n"] == 2 and deleted == "dead-letter queue":
            raise KeyError("never")
        if msg.attempt == 1:
            raise ConnectionError("the warehouse is down")

    layout = Layout(namespace)
    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"n": 1})  # retried through the delay queues: they exist
        wait_until(lambda: (1, 2) in attempts or run.error, "the first message retried")
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        channel = connection.channel()
        for queue in ([layout.group_delay_queue("orders", "shipping", b) for b in BUCKETS_MS]
                      if deleted == "delay queues" else [layout.dead_letter_queue("shipping")]):
            channel.queue_delete(queue)
        app.publish("orders", {"n": 2})
        if deleted == "delay queues":
            wait_until(lambda: (2, 2) in attempts or run.error, "the second message retried")
        else:
            dead_letters = layout.dead_letter_queue("shipping")
            wait_until(lambda: (queue_exists(amqp_url, dead_letters) and queue_length(amqp_url, dead_letters) == 1)
                       or run.error,
                       "the dead letter in the queue declared again")
        connection.close()
        app.stop()
        run.join()
    assert run.error is None, run.error
    assert any(e["event"] == "transport.queue_declared_again" for e in logs)
    assert not any(e["event"] == "dead_letter_copy_refused" for e in logs)
    app.close()


def test_a_topic_exchange_deleted_under_a_worker_is_declared_again_by_the_next_publish(
    tmp_path: Path, amqp_url: str, namespace: str
) -> None:
    """The old code: every publish refused with "404 NOT_FOUND - no exchange" (its declarations
    cached) and the worker's queue, unbound with the exchange, received nothing again."""
    done: list[int] = []
    app = worker_app(tmp_path, f"{amqp_url}?namespace={namespace}", done, RELIABLE_TRANSPORT__PUBLISH_TIMEOUT="2")
    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"n": 1})
        wait_until(lambda: done == [1], "the first message handled")
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        connection.channel().exchange_delete(Layout(namespace).exchange("orders"))
        connection.close()
        app.publish("orders", {"n": 2})
        wait_until(lambda: done == [1, 2], "the message published after the deletion handled")
        app.stop()
        run.join()
    assert run.error is None, run.error
    (again,) = [e for e in logs if e["event"] == "transport.declared_again"]
    assert again["groups"] == ["shipping"] and "no exchange" in again["error"]
    app.close()


def test_a_shutdown_owing_a_blocked_retry_copy_counts_the_handed_back_message_once(
    tmp_path: Path, own_rabbit: tuple[RabbitCluster, str], unique: str
) -> None:
    """A worker stopped during an alarm while its retry copy is blocked (owed) leaves its group:
    RabbitMQ takes the original back and counts that delivery (``x-delivery-count``), and may
    have enqueued the blocked copy as it blocked the connection: two copies of one attempt, met
    in one fetch. One is handled as the message's second delivery (not its third), its twin
    skipped by the token, and the message that never succeeds ends as one dead letter at
    ``max_redeliveries``."""
    cluster, node = own_rabbit
    url = f"{cluster.url(node)}?connect_timeout=1&namespace={unique}"
    attempts: list[int] = []
    env = {"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}", "RELIABLE_TRANSPORT__URL": url,
           "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1", "RELIABLE_RETRY__MAX_REDELIVERIES": "2",
           "RELIABLE_RETRY__INITIAL_DELAY": "0.1", "RELIABLE_RETRY__JITTER": "0"}

    def make() -> App:
        app = App(Settings.load(None, env=env))

        @app.handler("payments", group="billing")
        def bill(msg: Message, tx: object) -> None:
            attempts.append(msg.attempt)
            raise ConnectionError("the bank is down")  # retryable, for ever

        return app

    layout = Layout(unique)
    work = layout.queue("payments", "billing")
    first = make()
    first.publish("payments", {"n": 1})
    with resource_alarm(cluster, node):
        with capture_logs() as logs:
            run = Running(first)
            wait_until(lambda: any(e["event"] == "transport_writes_refused" for e in logs) or run.error,
                       "the retry copy refused by the alarm")
            first.stop()
            run.join()
        assert run.error is None, run.error
        assert attempts == [1]
        assert queue_length(cluster.url(node), work) >= 1  # the original handed back, its copy owed
    first.close()
    second = make()
    with capture_logs() as later:
        second.run(until_idle=True)  # the group's queues and delay queues empty, nothing held
    # the old pipeline cached the token of the attempt-2 twin it skipped (in the same fetch as
    # the one that failed), and skipped the retry as done: attempts [1, 2], no dead letter
    assert attempts == [1, 2, 3]  # the twin skipped, each delivery counted once
    assert second.stats()["duplicate"] == 1 and second.stats()["dead_lettered"] == 1
    assert len(second.dead_letters("billing")) == 1  # one message, one letter
    assert [e["attempt"] for e in later if e["event"] == "redelivery_scheduled"] == [2]
    with AmqpTransport(cluster.url(node), namespace=unique) as transport:
        transport.declare("billing", ["payments"])
        transport.purge()
    second.close()
