"""Publishing (`broker.delivery.publishing`): what a mixed batch becomes, and the placements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import pytest

from broker.delivery.engine import Broker
from broker.delivery.values import MessageColumns, OutgoingMessage, Placement, PlacementColumns
from broker.errors import DeliveryError
from broker.store import FakeClock
from broker.store.runs import run_ids
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


def mixed_batch(at: float) -> list[OutgoingMessage]:
    """Every field kind, a copy within the batch and one of an earlier publish."""
    return [
        OutgoingMessage(b"keyed", key="customer-7", message_id="k1"),
        OutgoingMessage(b"tagged", tag="t", headers={"h": "v"}, message_id="t1"),
        OutgoingMessage(b"asked", queue=2, message_id="q2"),
        OutgoingMessage(b"keyed again", key="customer-7", message_id="k1"),
        OutgoingMessage(b"later", deliver_at=at + 5, headers={"x": "y"}),
        OutgoingMessage(b"seen", message_id="seen"),
        OutgoingMessage(b"plain"),
    ]


def test_a_column_publish_places_and_stores_what_the_row_publish_does(
    open_broker: Callable[..., Broker], tmp_path: Path, clock: FakeClock
) -> None:
    by_rows, by_columns = open_broker(tmp_path / "rows"), open_broker(tmp_path / "columns")
    batch = mixed_batch(clock.time())
    for broker in (by_rows, by_columns):
        broker.publish("orders", [OutgoingMessage(b"first", message_id="seen", queue=1)])
    placed_rows = by_rows.publish("orders", batch)
    placed = by_columns.publish_columns("orders", MessageColumns.of(batch))
    assert isinstance(placed, PlacementColumns)
    assert [replace(p, message_id=m.message_id or "made") for p, m in zip(placed.placements(), batch)] == [
        replace(p, message_id=m.message_id or "made") for p, m in zip(placed_rows, batch)]  # ids the store made differ
    assert [p.duplicate for p in placed_rows] == [False, False, False, True, False, True, False]
    assert placed_rows[5] == Placement("orders", 1, 0, "seen", duplicate=True)
    clock.advance(5)
    received = []
    for broker in (by_rows, by_columns):
        member = broker.join("g", ["orders"])
        received.append(sorted((d.body, d.key, d.tag, dict(d.headers), d.queue, d.offset)
                               for d in drain(broker, member)))
    assert received[0] == received[1] and len(received[0]) == 6
    later = next(r for r in received[1] if r[0] == b"later")
    assert later[3]["x"] == "y"


def test_a_column_publish_with_fields_the_same_for_all(broker: Broker) -> None:
    messages = MessageColumns(3, {"key": "", "tag": "t", "headers": {"h": "v"}, "message_id": "same",
                                  "queue": 1, "deliver_at": 0.0},
                              {"body": [b"a", b"b", b"c"]})
    placed = broker.publish_columns("orders", messages).placements()
    assert placed == [Placement("orders", 1, 0, "same")] + [Placement("orders", 1, 0, "same", True)] * 2
    member = broker.join("g", ["orders"])
    assert [(d.body, d.tag, d.headers["h"]) for d in drain(broker, member)] == [(b"a", "t", "v")]


def test_a_column_publish_with_a_body_not_bytes_stores_nothing(broker: Broker) -> None:
    with pytest.raises(DeliveryError, match="body must be bytes"):
        broker.publish_columns("orders", MessageColumns.of([OutgoingMessage(b"ok"), OutgoingMessage("text")]))  # type: ignore[arg-type]
    assert broker.queue_offsets("orders") == [[0, 0]] * len(broker.queue_offsets("orders"))


def anonymous(count: int, prefix: str = "b") -> MessageColumns:
    return MessageColumns.of([OutgoingMessage(f"{prefix}{n}".encode()) for n in range(count)])


def test_a_batch_named_by_a_batch_id_gets_its_ids_from_it_and_a_resend_is_dropped_whole(
    broker: Broker,
) -> None:
    first = broker.publish_columns("orders", anonymous(5), [("tok", 5)]).placements()
    assert [p.message_id for p in first] == ["tok.0", "tok.1", "tok.2", "tok.3", "tok.4"]
    again = broker.publish_columns("orders", anonymous(5), [("tok", 5)]).placements()
    assert again == [replace(p, duplicate=True) for p in first]
    with pytest.raises(DeliveryError, match="with 5 messages; this one has 4"):
        broker.publish_columns("orders", anonymous(4), [("tok", 4)])
    with pytest.raises(DeliveryError, match="only messages without an id"):
        broker.publish_columns("orders", MessageColumns.of([OutgoingMessage(b"x", message_id="m")]),
                               [("other", 1)])
    twice = broker.publish_columns("orders", anonymous(4), [("new", 2), ("new", 2)]).placements()
    assert [p.duplicate for p in twice] == [False, False, True, True] and twice[2:] == [
        replace(p, duplicate=True) for p in twice[:2]]
    member = broker.join("g", ["orders"])
    assert sorted(d.message_id for d in drain(broker, member)) == [
        "new.0", "new.1", "tok.0", "tok.1", "tok.2", "tok.3", "tok.4"]


def test_after_a_restart_the_store_answers_for_a_batch_id_and_a_torn_batch_gets_its_tail(
    open_broker: Callable[..., Broker], tmp_path: Path
) -> None:
    broker = open_broker()
    whole = broker.publish_columns("orders", anonymous(3, "w"), [("whole", 3)]).placements()
    cut = broker.publish_columns("orders", anonymous(10), [("cut", 10)]).placements()
    fifth = broker.store.lookup_id("cut.4")
    assert fifth is not None
    broker.close()
    [segment] = (tmp_path / "broker").rglob("*.log")
    with open(segment, "r+b") as log:  # a torn write: cut.0 .. cut.3 whole, cut.4 in part
        log.truncate(fifth.log_offset + 20)
    broker = open_broker()
    assert broker.publish_columns("orders", anonymous(3, "w"), [("whole", 3)]).placements() == [
        replace(p, duplicate=True) for p in whole]
    resent = broker.publish_columns("orders", anonymous(10), [("cut", 10)]).placements()
    assert [p.duplicate for p in resent] == [True] * 4 + [False] * 6
    assert resent[:4] == [replace(p, duplicate=True) for p in cut[:4]]
    assert [p.message_id for p in resent] == run_ids("cut", 10)
    member = broker.join("g", ["orders"])
    bodies = sorted(d.body for d in drain(broker, member))
    assert bodies == sorted([b"w0", b"w1", b"w2", *(f"b{n}".encode() for n in range(10))])
    assert [m and m.message_id for m in broker.store.lookup_run("cut", 10)] == run_ids("cut", 10)
