"""Publishing (`broker.delivery.publishing`): what a mixed batch becomes, and the placements."""

from __future__ import annotations

from dataclasses import fields

from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage, Placement
from broker.store import FakeClock
from tests.broker.delivery.conftest import drain


def test_placements_are_whole_placements(broker: Broker) -> None:
    (placed,) = broker.publish("orders", [OutgoingMessage(b"x", message_id="a")])
    made = Placement(**{spec.name: getattr(placed, spec.name) for spec in fields(Placement)})
    assert vars(placed) == vars(made) and placed == Placement("orders", placed.queue, 0, "a")


def test_a_mixed_batch_keeps_each_message_its_queue_and_drops_only_the_copies(
    broker: Broker, clock: FakeClock
) -> None:
    broker.publish("orders", [OutgoingMessage(b"old", message_id="seen", queue=3)])
    batch = [
        OutgoingMessage(b"k1", key="customer-7", message_id="k1"),
        OutgoingMessage(b"again", message_id="seen"),  # seen before: the first copy's placement
        OutgoingMessage(b"q2", message_id="q2", queue=2),
        OutgoingMessage(b"k1 twice", key="customer-7", message_id="k1"),  # a copy within the batch
        OutgoingMessage(b"later", tag="t", headers={"h": "v"}, deliver_at=clock.time() + 5),
        OutgoingMessage(b"plain"),
    ]
    placed = broker.publish("orders", batch)
    assert [p.duplicate for p in placed] == [False, True, False, True, False, False]
    assert placed[1] == Placement("orders", 3, 0, "seen", duplicate=True)
    assert placed[3] == Placement("orders", placed[0].queue, placed[0].offset, "k1", duplicate=True)
    assert placed[2].queue == 2
    member = broker.join("g", ["orders"])
    clock.advance(5)
    received = {d.body: d for d in drain(broker, member)}
    assert sorted(received) == [b"k1", b"later", b"old", b"plain", b"q2"]
    assert received[b"later"].tag == "t" and received[b"later"].headers["h"] == "v"
    assert (received[b"k1"].queue, received[b"k1"].offset) == (placed[0].queue, placed[0].offset)


def test_an_empty_publish_places_nothing(broker: Broker) -> None:
    assert broker.publish("orders", []) == []
