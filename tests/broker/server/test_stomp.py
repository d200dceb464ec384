"""The STOMP listener driven by a real STOMP client (stomp.py), versions 1.1 and 1.2.

One server process with users and a short redelivery policy for the module;
each test uses destinations of its own. "Nothing more comes" is shown by the
server's own state, never by a look of fixed length: the group has nothing
left (`settled`), or the server's count of deliveries on the topic
(`delivered`, from its /metrics) equals what the client holds.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import stomp
from prometheus_client.parser import text_string_to_metric_families
from stomp.exception import ConnectFailedException

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess
from tests.passwords import hash_password
from tests.waiting import wait_until

WAIT = 20.0


class Inbox(stomp.ConnectionListener):
    """What a connection received: MESSAGE, RECEIPT and ERROR frames."""

    def __init__(self) -> None:
        self.messages: list[stomp.utils.Frame] = []
        self.receipts: list[str] = []
        self.errors: list[stomp.utils.Frame] = []
        self.heartbeats: list[float] = []
        self.changed = threading.Condition()

    def on_message(self, frame) -> None:  # type: ignore[no-untyped-def]
        with self.changed:
            self.messages.append(frame)
            self.changed.notify_all()

    def on_receipt(self, frame) -> None:  # type: ignore[no-untyped-def]
        with self.changed:
            self.receipts.append(frame.headers["receipt-id"])
            self.changed.notify_all()

    def on_error(self, frame) -> None:  # type: ignore[no-untyped-def]
        with self.changed:
            self.errors.append(frame)
            self.changed.notify_all()

    def on_heartbeat(self) -> None:
        with self.changed:
            self.heartbeats.append(time.monotonic())
            self.changed.notify_all()

    def wait_for(self, count: int, what: str = "messages") -> list:  # type: ignore[type-arg]
        with self.changed:
            self.changed.wait_for(lambda: len(getattr(self, what)) >= count, timeout=WAIT)
            return list(getattr(self, what))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("stomp")
    settings = folder / "reliable.toml"
    settings.write_text(
        "[broker]\nstomp_max_redeliveries = 2\nstomp_redelivery_delay = 0.2\nmetrics_port = 0\n"
        f'[broker.users.app]\npassword_hash = "{hash_password("s3cret")}"\n'
        'produce = ["*"]\nconsume = ["*"]\ngroups = ["*"]\n'
        f'[broker.users.reader]\npassword_hash = "{hash_password("r3ad")}"\n'
        'produce = []\nconsume = ["orders-*"]\n')
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def settled(server: ServerProcess, group: str) -> None:
    """Wait until the broker reports nothing left for ``group`` on its topic: every message acked
    or dead-lettered, so nothing more can be delivered to it."""
    client = Client(server.url, user="app", password="s3cret")
    try:
        wait_until(lambda: client.pending(group, [group]) == 0, f"group {group!r} to have nothing left to deliver")
    finally:
        client.close()


def delivered(server: ServerProcess, topic: str) -> int:
    """How many MESSAGE frames the server has sent on ``topic`` (its own count, from /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as page:
        families = text_string_to_metric_families(page.read().decode())
        return int(sum(sample.value for family in families if family.name == "broker_messages_delivered"
                       for sample in family.samples
                       if sample.name.endswith("_total") and sample.labels.get("topic") == topic))


def connect(server: ServerProcess, version: str = "1.2", user: str = "app",
            password: str = "s3cret", **options) -> tuple[stomp.Connection, Inbox]:  # type: ignore[no-untyped-def]
    kind = stomp.Connection12 if version == "1.2" else stomp.Connection11
    connection = kind([("127.0.0.1", server.stomp_port)], **options)
    inbox = Inbox()
    connection.set_listener("inbox", inbox)
    connection.connect(user, password, wait=True)
    return connection, inbox


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_send_and_receive_binary_and_non_ascii_bodies_with_receipts(server, unique, version) -> None:
    connection, inbox = connect(server, version, auto_decode=False)  # bodies as bytes
    destination = f"/queue/{unique}"
    connection.subscribe(destination, id="1", ack="client-individual")
    bodies = [b"\x00\x01binary\x00body\xff", "café ünïcode €".encode()]
    for number, body in enumerate(bodies):
        connection.send(destination, body, headers={"content-type": "application/octet-stream"},
                        receipt=f"r{number}")
    assert inbox.wait_for(2, "receipts") == ["r0", "r1"]
    received = inbox.wait_for(2)
    assert sorted(m.body for m in received) == sorted(bodies)
    for message in received:
        assert message.headers["message-id"] and message.headers["destination"] == destination
        ack = message.headers.get("ack") or message.headers["message-id"]
        connection.ack(ack, subscription="1") if version == "1.1" else connection.ack(ack)
    connection.disconnect()


def test_client_ack_is_cumulative_and_unacked_messages_come_back(server, unique) -> None:
    destination = f"/queue/{unique}"
    sender, _ = connect(server)
    for number in range(4):
        sender.send(destination, f"m{number}")
    first, inbox = connect(server)
    first.subscribe(destination, id="1", ack="client")
    received = inbox.wait_for(4)
    first.ack(received[1].headers["ack"])  # client mode: acks the first two delivered
    first.disconnect()  # the other two were never acked
    second, again = connect(server)
    second.subscribe(destination, id="1", ack="client-individual")
    redelivered = again.wait_for(2)
    for message in redelivered:
        second.ack(message.headers["ack"])
    settled(server, unique)  # m0 and m1 were acked by the first: nothing else can come
    assert sorted(m.body for m in again.messages) == sorted(m.body for m in received[2:])
    assert all(m.headers.get("redelivered") == "true" for m in redelivered)
    second.disconnect()
    sender.disconnect()


def test_prefetch_size_bounds_the_unacknowledged_messages_in_flight(server, unique) -> None:
    destination = f"/queue/{unique}"
    connection, inbox = connect(server)
    for number in range(5):
        connection.send(destination, f"m{number}")
    connection.subscribe(destination, id="1", ack="client-individual",
                         headers={"activemq.prefetchSize": "2"})
    first = inbox.wait_for(2)
    assert delivered(server, unique) == 2  # the server sent no third: its window is full
    assert len(inbox.messages) == 2
    connection.ack(first[0].headers["ack"])
    assert len(inbox.wait_for(3)) == 3
    assert delivered(server, unique) == 3  # one ack opened the window by one
    assert len(inbox.messages) == 3
    connection.disconnect()


def test_nack_follows_the_redelivery_policy_then_the_dead_letter_queue(server, unique) -> None:
    connection, inbox = connect(server)
    connection.subscribe(f"/queue/{unique}", id="1", ack="client-individual")
    connection.send(f"/queue/{unique}", "poison")
    for delivery in range(1, 4):  # the first delivery and 2 redeliveries, each NACKed
        message = inbox.wait_for(delivery)[-1]
        connection.nack(message.headers["ack"])
    settled(server, unique)  # the third NACK dead-lettered it: nothing more can come
    assert len(inbox.messages) == 3
    connection.subscribe(f"/queue/%DLQ%{unique}", id="2", ack="auto")
    letter = inbox.wait_for(4)[-1]
    assert letter.body == "poison" and "NACKed after 2 redeliveries" in letter.headers["x-dlq-cause"]
    connection.disconnect()


def test_a_transaction_sends_and_acks_on_commit_and_nothing_on_abort(server, unique) -> None:
    destination = f"/queue/{unique}"
    connection, inbox = connect(server)
    connection.subscribe(destination, id="1", ack="client-individual")
    aborted = connection.begin()
    connection.send(destination, "never", transaction=aborted)
    connection.abort(aborted)
    committed = connection.begin()
    connection.send(destination, "once", transaction=committed, headers={"receipt": "sent"})
    assert inbox.wait_for(1, "receipts") == ["sent"]  # the server has taken both SENDs
    settled(server, unique)  # and published neither: the topic holds nothing for the group
    assert inbox.messages == []  # nothing before COMMIT
    connection.commit(committed)
    (message,) = inbox.wait_for(1)
    assert message.body == "once"
    connection.disconnect()


def test_acks_in_a_transaction_count_on_commit_and_not_on_abort(server, unique) -> None:
    destination = f"/queue/{unique}"
    connection, inbox = connect(server)
    connection.subscribe(destination, id="1", ack="client-individual")
    connection.send(destination, "kept")
    connection.send(destination, "acked")
    received = {m.body: m for m in inbox.wait_for(2)}
    aborted = connection.begin()
    connection.ack(received["kept"].headers["ack"], transaction=aborted)
    connection.abort(aborted)
    committed = connection.begin()
    connection.ack(received["acked"].headers["ack"], transaction=committed)
    connection.commit(committed)
    connection.disconnect()  # its receipt comes once the subscription left its group
    again, second = connect(server)
    again.subscribe(destination, id="1", ack="client-individual")
    (back,) = second.wait_for(1)
    again.ack(back.headers["ack"])
    settled(server, unique)  # "acked" was done by the commit: nothing else can come
    assert [m.body for m in second.messages] == ["kept"] and back.headers["redelivered"] == "true"
    again.disconnect()


def test_topics_broadcast_to_every_subscriber(server, unique) -> None:
    first, one = connect(server)
    second, two = connect(server)
    for connection, inbox in ((first, one), (second, two)):  # subscriptions start at the topic's end:
        connection.subscribe(f"/topic/{unique}", id="1", ack="auto", headers={"receipt": "joined"})
        assert inbox.wait_for(1, "receipts") == ["joined"]  # so both have joined before the send
    first.send(f"/topic/{unique}", "news")
    assert one.wait_for(1)[0].body == two.wait_for(1)[0].body == "news"
    first.disconnect()
    second.disconnect()


def test_heart_beats_keep_an_idle_connection_open(server, unique) -> None:
    connection, inbox = connect(server, heartbeats=(200, 200))
    # the server beats every 1 s and closes a connection silent for 2 s: three of its beats span more
    # than that, with nothing but the client's beats coming in
    assert len(inbox.wait_for(3, "heartbeats")) >= 3
    assert connection.is_connected()
    connection.send(f"/queue/{unique}", "still here", receipt="alive")
    assert inbox.wait_for(1, "receipts") == ["alive"]
    connection.disconnect()


def test_bad_credentials_are_refused_and_permissions_hold(server, unique) -> None:
    with pytest.raises(ConnectFailedException):
        connect(server, password="wrong")
    reader, inbox = connect(server, user="reader", password="r3ad")
    reader.send(f"/queue/{unique}", "not allowed", receipt="x")
    errors = inbox.wait_for(1, "errors")
    assert "permission" in errors[0].headers.get("message", "").lower()


class Stalled(Inbox):
    """Takes the first MESSAGE, then stops reading (its listener blocks stomp.py's receiver
    thread): the server's writes to it stall with the rest of its fetch still unsent."""

    def __init__(self) -> None:
        super().__init__()
        self.go_on = threading.Event()

    def on_message(self, frame) -> None:  # type: ignore[no-untyped-def]
        super().on_message(frame)
        self.go_on.wait(WAIT)


UNSENT_MESSAGES, UNSENT_BODY = 400, b"x" * 65536  # 26 MB: far more than the socket buffers hold


@pytest.mark.parametrize("ending", ["DISCONNECT", "connection cut"])
def test_a_message_never_sent_comes_back_not_redelivered(server, unique, ending) -> None:
    """A subscription fetches (leases) all its prefetch at once, then sends it frame by frame.
    When its connection ends while most of them are still unsent, those come back with their
    delivery count unmoved: ``redelivered: false``; only the frames the server wrote count."""
    destination = f"/queue/{unique}"
    producer = Client(server.url, user="app", password="s3cret")
    for start in range(0, UNSENT_MESSAGES, 50):
        producer.publish(unique, [OutgoingMessage(UNSENT_BODY, message_id=f"{unique}-{n}")
                                  for n in range(start, start + 50)])
    first = stomp.Connection12([("127.0.0.1", server.stomp_port)], auto_decode=False)
    stalled = Stalled()
    first.set_listener("stalled", stalled)
    first.connect("app", "s3cret", wait=True)
    first.subscribe(destination, id="1", ack="client-individual",
                    headers={"activemq.prefetchSize": str(UNSENT_MESSAGES)})
    stalled.wait_for(1)
    wait_until(lambda: delivered(server, unique) >= 2, "the server's writes to the stalled client")
    if ending == "DISCONNECT":
        first.send_frame("DISCONNECT", {})  # the server stops the subscription, then the session
        wait_until(lambda: _members(producer, unique) == 0, "the stalled subscription to leave")
    else:
        first.transport.socket.close()  # unread data in its buffer: the kernel resets the connection
        wait_until(lambda: _members(producer, unique) == 0, "the cut connection's member to leave")
    written = delivered(server, unique)  # MESSAGE frames the server wrote (it counts each once written)
    stalled.go_on.set()
    assert written < UNSENT_MESSAGES / 2, "the socket buffers took most of the fetch: nothing was left unsent"
    again = stomp.Connection12([("127.0.0.1", server.stomp_port)], auto_decode=False)
    inbox = Inbox()
    again.set_listener("inbox", inbox)
    again.connect("app", "s3cret", wait=True)
    again.subscribe(destination, id="1", ack="auto", headers={"activemq.prefetchSize": "50"})
    received = wait_until(lambda: len(inbox.messages) >= UNSENT_MESSAGES and inbox.messages,
                          "every message back")
    redelivered = sum(m.headers["redelivered"] == "true" for m in received)
    assert written <= redelivered <= written + 1  # the frame being written when it ended may count
    again.disconnect()
    producer.close()


def _members(client: Client, group: str) -> int:
    return sum(info.members for info in client.groups() if info.name == group)
