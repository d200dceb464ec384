"""A retry or dead-letter copy is its original with headers more: the largest record a producer
may publish leaves room for them (`broker.store.prepare.COPY_HEADROOM`). Before, a message just
under ``max_record_size`` was taken and its copy refused: the nack failed, and a fetch whose
sweep dead-lettered its expired lease (``max_deliveries`` spent) failed for every member of the
group, again at every fetch."""

from __future__ import annotations

import pytest

from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.errors import RecordTooLargeError
from broker.store import FakeClock
from tests.broker.delivery.conftest import Open

LIMIT = 64 * 1024


def largest(broker: Broker, topic: str) -> bytes:
    """The largest body ``topic`` takes (with the key, id and header the tests send), by bisection
    (to a topic of its own, as long, each probe under an id of its own: a repeated one is dropped)."""
    low, high = LIMIT // 2, LIMIT
    while high - low > 1:
        middle = (low + high) // 2
        try:
            broker.publish(f"{topic[:-1]}X", [OutgoingMessage(b"x" * middle, key="k", message_id=f"{middle:08d}",
                                                              headers={"h": "v"})])  # an id as long as "big00000"
        except RecordTooLargeError:
            high = middle
        else:
            low = middle
    return b"x" * low


@pytest.fixture
def broker(open_broker: Open) -> Broker:
    return open_broker(max_deliveries=2, lease=5.0, store_max_record_size=LIMIT, store_segment_size=1024 * 1024)


def test_the_largest_record_is_refused_naming_the_room_left_for_its_copies(broker: Broker) -> None:
    with pytest.raises(RecordTooLargeError, match=rf"above max_record_size={LIMIT} less the \d+ bytes kept "
                                                  "for the headers of its retry and dead-letter copies"):
        broker.publish("orders", [OutgoingMessage(b"x" * (LIMIT - 200))])


def test_the_largest_message_is_retried_then_dead_lettered_by_copies(broker: Broker) -> None:
    body = largest(broker, "orders")
    broker.publish("orders", [OutgoingMessage(body, key="k", message_id="big00000", headers={"h": "v"})])
    member = broker.join("g", ["orders"])
    (first,) = broker.fetch(member, 10, 0)
    broker.nack(member, [first.receipt], 0.0)  # its %RETRY% copy was refused
    (again,) = broker.fetch(member, 10, 0)
    assert (again.body, again.delivery_count) == (body, 2)
    broker.nack(member, [again.receipt], 0.0)  # max_deliveries spent: to %DLQ%
    (letter,) = broker.dlq_list("g")
    assert letter.body == body and letter.headers["x-dlq-cause"].startswith("delivered 2 times")


def test_a_fetch_dead_letters_the_largest_message_whose_lease_expired(broker: Broker, clock: FakeClock) -> None:
    body = largest(broker, "orders")
    broker.publish("orders", [OutgoingMessage(body, key="k", message_id="big00000", headers={"h": "v"}),
                              OutgoingMessage(b"small", key="other", message_id="small")])
    member = broker.join("g", ["orders"])
    for _ in range(2):  # delivered twice, its lease expiring each time
        fetched = broker.fetch(member, 10, 0)
        assert "big00000" in [d.message_id for d in fetched]
        broker.ack(member, [d.receipt for d in fetched if d.message_id == "small"])
        clock.advance(6.0)
    assert [d.message_id for d in broker.fetch(member, 10, 0)] == []  # raised for ever before
    (letter,) = broker.dlq_list("g")
    assert letter.body == body and "its lease expired" in letter.headers["x-dlq-cause"]


def test_a_dead_letter_cause_is_cut_to_fit(broker: Broker) -> None:
    body = largest(broker, "orders")
    broker.publish("orders", [OutgoingMessage(body, key="k", message_id="big00000", headers={"h": "v"})])
    member = broker.join("g", ["orders"])
    (delivery,) = broker.fetch(member, 10, 0)
    broker.dead_letter(member, [delivery.receipt], "why " * 10_000)
    (letter,) = broker.dlq_list("g")
    assert letter.body == body and letter.headers["x-dlq-cause"].endswith("cut]")
