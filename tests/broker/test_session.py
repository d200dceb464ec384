"""ActiveMQ's acknowledgement modes (`broker.session`) on the real engine, and over the TCP server.

Each test receives part of a topic in one session, closes it (its member
leaves: whatever it left unacknowledged goes back to the group), and reads
what a second session of the same group still gets: that is what the first
one acknowledged, seen from the broker's side.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import Client
from broker.delivery.api import BrokerApi
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.session import AckMode, Session, SessionError
from broker.store import FakeClock, StoreConfig
from tests.broker.server.serving import ServerProcess


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def broker(tmp_path: Path, clock: FakeClock) -> Iterator[Broker]:
    opened = Broker(tmp_path / "broker", DeliveryConfig(max_deliveries=3), store_config=StoreConfig(clock=clock),
                    clock=clock)
    yield opened
    opened.close()


def publish(api: BrokerApi, count: int, topic: str = "orders") -> None:
    api.publish(topic, [OutgoingMessage(f"m{n}".encode(), key="one-queue", message_id=f"m{n}")
                        for n in range(count)])


def left_for(api: BrokerApi, group: str = "g", topic: str = "orders") -> list[tuple[str, int]]:
    """What a fresh member of ``group`` receives now (id, delivery count), acknowledging it."""
    with Session(api, group, [topic], AckMode.AUTO) as session:
        received = []
        while (delivery := session.receive()) is not None:
            received.append((delivery.message_id, delivery.delivery_count))
        return sorted(received)


def receive(session: Session, count: int) -> list:
    return [session.receive() for _ in range(count)]


def test_auto_acknowledges_each_message_as_it_is_received(broker: Broker) -> None:
    publish(broker, 5)
    with Session(broker, "g", ["orders"], AckMode.AUTO, prefetch=10) as session:
        assert [d.message_id for d in receive(session, 3)] == ["m0", "m1", "m2"]
    assert left_for(broker) == [("m3", 1), ("m4", 1)]  # fetched ahead, never received: released


def test_client_acknowledge_covers_everything_received_so_far(broker: Broker) -> None:
    publish(broker, 5)
    with Session(broker, "g", ["orders"], AckMode.CLIENT) as session:
        first, _second, _third = receive(session, 3)
        session.acknowledge(first)  # cumulative: first, second and third
        assert session.receive().message_id == "m3"  # received, never acknowledged
    assert left_for(broker) == [("m3", 2), ("m4", 1)]  # m4 only fetched ahead: released


def test_individual_acknowledge_covers_one_message(broker: Broker) -> None:
    publish(broker, 4)
    with Session(broker, "g", ["orders"], AckMode.INDIVIDUAL) as session:
        _first, second, _third = receive(session, 3)
        session.acknowledge(second)
        session.acknowledge(second)  # twice changes nothing
        with pytest.raises(SessionError, match="names the message"):
            session.acknowledge()
    assert left_for(broker) == [("m0", 2), ("m2", 2), ("m3", 1)]  # m3 only fetched ahead: released


def test_recover_hands_back_what_was_not_acknowledged(broker: Broker) -> None:
    publish(broker, 2)
    with Session(broker, "g", ["orders"], AckMode.CLIENT, prefetch=5) as session:
        assert session.receive().message_id == "m0"  # m1 fetched ahead with it
        session.recover()
        again = sorted((d.message_id, d.delivery_count) for d in receive(session, 2))
        assert again == [("m0", 2), ("m1", 1)]  # m0 handed back and counted; m1 received from ahead
        session.acknowledge()
    assert left_for(broker) == []


def test_dups_ok_acknowledges_lazily_at_a_fraction_of_the_prefetch_or_a_timeout(
    broker: Broker, clock: FakeClock
) -> None:
    publish(broker, 20)
    session = Session(broker, "g", ["orders"], AckMode.DUPS_OK, prefetch=10, dups_ok_fraction=0.5,
                      dups_ok_timeout=2.0, clock=clock.time)
    receive(session, 4)
    assert broker.pending("g", ["orders"]) == 20  # four owed: nothing sent yet
    session.receive()
    assert broker.pending("g", ["orders"]) == 15  # the fifth makes half the prefetch: one batch
    session.receive()
    clock.advance(1.9)
    session.receive()
    assert broker.pending("g", ["orders"]) == 15  # two owed, the oldest for 1.9 s
    clock.advance(0.1)
    session.receive()
    assert broker.pending("g", ["orders"]) == 13  # the oldest owed waited 2 s: both sent
    session.receive()
    session.close()  # what is owed goes out before the member leaves
    assert broker.pending("g", ["orders"]) == 11


def test_transacted_commit_publishes_then_acknowledges_and_rollback_hands_back(
    broker: Broker, clock: FakeClock
) -> None:
    publish(broker, 3)
    delays: list[int] = []
    session = Session(broker, "g", ["orders"], AckMode.TRANSACTED, prefetch=1,
                      redelivery_delay=lambda count: delays.append(count) or 5.0 * count)
    received = session.receive()
    assert session.send("invoices", [OutgoingMessage(b"for m0", message_id="i0")]) == []
    session.rollback()
    assert broker.topics() == [t for t in broker.topics() if t.name != "invoices"]  # the send was dropped
    assert delays == [1] and session.receive().message_id == "m1"  # m0 waits 5 s
    clock.advance(5.0)
    session.rollback()  # m1 back too, after 5 s
    again = session.receive()
    assert (again.message_id, again.delivery_count) == (received.message_id, 2)
    session.send("invoices", [OutgoingMessage(b"for m0", message_id="i0")])
    placed = session.commit()
    assert [p.message_id for p in placed] == ["i0"]
    session.close()
    assert left_for(broker, "billing", "invoices") == [("i0", 1)]
    clock.advance(5.0)
    assert left_for(broker) == [("m1", 2), ("m2", 1)]


def test_a_message_rolled_back_past_max_deliveries_is_dead_lettered(broker: Broker) -> None:
    publish(broker, 1)
    with Session(broker, "g", ["orders"], AckMode.TRANSACTED, prefetch=1) as session:
        for count in (1, 2, 3):
            delivery = session.receive()
            assert delivery.delivery_count == count
            session.rollback()
        assert session.receive() is None
    (letter,) = broker.dlq_list("g")
    assert letter.message_id == "m0" and letter.headers["x-dlq-cause"].startswith("delivered 3 times")


def test_messages_fetched_ahead_and_never_received_are_released_at_close(broker: Broker) -> None:
    """Short sessions with a large prefetch: what each fetched ahead and never received comes back
    with its delivery count unmoved, so it never spends ``max_deliveries`` (3) and is never dead-lettered."""
    publish(broker, 5)
    for n in range(4):
        with Session(broker, "g", ["orders"], AckMode.CLIENT, prefetch=10) as session:
            delivery = session.receive()
            assert (delivery.message_id, delivery.delivery_count) == (f"m{n}", 1)
            session.acknowledge()
    assert left_for(broker) == [("m4", 1)]
    assert broker.dlq_list("g") == []


def test_calls_outside_the_mode_and_on_a_closed_session_are_refused(broker: Broker) -> None:
    session = Session(broker, "g", ["orders"], AckMode.AUTO)
    for call in (session.acknowledge, session.recover, session.commit, session.rollback):
        with pytest.raises(SessionError, match="AUTO"):
            call()
    session.close()
    with pytest.raises(SessionError, match="closed"):
        session.receive()
    with pytest.raises(SessionError, match="prefetch"):
        Session(broker, "g", ["orders"], prefetch=0)


def test_the_modes_over_the_tcp_server(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data").start()
    client = Client(server.url)
    try:
        publish(client, 4)
        with Session(client, "g", ["orders"], AckMode.INDIVIDUAL) as session:
            _first, second = receive(session, 2)
            session.acknowledge(second)
        with Session(client, "g", ["orders"], AckMode.TRANSACTED) as session:
            got = receive(session, 3)
            session.commit()
        # m0 was received and not acknowledged: a delivery; m2 and m3 were only fetched ahead: released
        assert sorted((d.message_id, d.delivery_count) for d in got) == [("m0", 2), ("m2", 1), ("m3", 1)]
        assert left_for(client) == []
    finally:
        client.close()
        server.stop()
