"""Acks of whole fetches, of parts of them, and of receipts in any order: the receipt table
stays in step with what the cursors hold, and the prefetch window with both."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from broker.delivery.engine import Broker
from broker.delivery.values import (
    Delivery,
    DeliveryColumns,
    OutgoingMessage,
    Placement,
    deliveries,
    joined,
)
from broker.errors import DeliveryError
from broker.store import FakeClock
from tests.broker.delivery.conftest import Open, messages


def held(broker: Broker) -> dict[str, Delivery]:
    """What the cursors hold, by receipt (checked against the broker's receipt table)."""
    cursors = [c for g in broker.consuming.membership.group_table.values() for c in g.all_cursors()]
    found = {d.receipt: d for c in cursors for d in map(c.delivery, c.held)}
    assert {r: lease.cursor.delivery(lease.offsets[r]) for r, lease in broker.consuming.leases.receipts.items()} == found
    assert {(r, o) for c in cursors for lease in c.leases for r, o in lease.offsets.items()} == {
        (d.receipt, d.offset) for d in found.values()}
    return found


def test_many_deliveries_equal_the_constructor() -> None:
    made = deliveries(3, {"topic": "t", "queue": 1, "key": "", "tag": "x", "delivery_count": 1},
                      {"receipt": ["a", "b", "c"], "offset": [4, 5, 6], "message_id": ["i", "j", "k"],
                       "body": [b"1", b"2", b"3"], "headers": [{}, {"h": "v"}, {}],
                       "published_at": [1.0, 2.0, 3.0]})
    assert all(type(d) is Delivery for d in made)
    assert made == [Delivery(r, "t", 1, o, i, b, "", "x", h, 1, p) for r, o, i, b, h, p in zip(
        "abc", (4, 5, 6), "ijk", (b"1", b"2", b"3"), ({}, {"h": "v"}, {}), (1.0, 2.0, 3.0))]


def test_a_fetch_column_by_column_holds_what_a_fetch_of_deliveries_would(open_broker: Open) -> None:
    broker = open_broker(queues=2, prefetch=100, read_batch=7)
    broker.publish("orders", messages(20))
    columns_member, deliveries_member = broker.join("a", ["orders"]), broker.join("b", ["orders"])
    taken = joined(broker.consuming.fetch(columns_member, 30, 0) or [])
    fetched = broker.fetch(deliveries_member, 30, 0)
    assert taken.count == len(fetched) == 20
    strip = {"receipt": ""}
    assert [d._replace(**strip) for d in taken.deliveries()] == [d._replace(**strip) for d in fetched]
    assert held(broker) == {d.receipt: d for d in (*taken.deliveries(), *fetched)}
    assert joined([DeliveryColumns.of(fetched[:3]), DeliveryColumns.of(fetched[3:])]).deliveries() == fetched


def test_acks_in_any_order_and_in_parts_finish_exactly_what_they_name(open_broker: Open) -> None:
    broker = open_broker(queues=3, prefetch=100, read_batch=7)
    broker.publish("orders", messages(90))
    member = broker.join("g", ["orders"])
    rng = random.Random(7)
    done: set[str] = set()
    while out := broker.fetch(member, 40, 0):
        assert len(held(broker)) == len(out) and broker.consuming.leases.held(member) == len(out)
        receipts = [d.receipt for d in out]
        rng.shuffle(receipts)
        first, rest = receipts[: len(receipts) // 3], receipts[len(receipts) // 3 :]
        broker.ack(member, first + first[:2] + ["1:0:9", "junk"])  # repeats and strangers ignored
        assert set(held(broker)) == set(rest) and broker.consuming.leases.held(member) == len(rest)
        broker.ack(member, rest)
        done |= {d.message_id for d in out}
        assert held(broker) == {} and broker.consuming.leases.held(member) == 0
    assert done == {f"m{n}" for n in range(90)} and broker.pending("g", ["orders"]) == 0
    assert [c.done for c in broker.consuming.membership.group_table["g"].cursors.values()] == [set()] * 4


def test_delivered_and_extend_of_part_of_a_fetch(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker(queues=1, prefetch=6, lease=10.0)
    broker.publish("orders", messages(10))
    member = broker.join("g", ["orders"])
    out = broker.fetch(member, 6, 0)
    broker.delivered(member, [out[0].receipt, out[1].receipt, out[1].receipt])
    assert broker.consuming.leases.held(member) == 4
    assert [d.message_id for d in broker.fetch(member, 6, 0)] == ["m6", "m7"]
    clock.advance(6)
    broker.extend(member, [out[0].receipt, out[2].receipt])
    clock.advance(6)  # the others' leases ended; m0 and m2 are still out
    again = broker.fetch(member, 10, 0)  # m2 counts in the window, m0 (DELIVERED) does not
    assert [d.message_id for d in again] == ["m1", "m3", "m4", "m5", "m6"]
    assert {d.message_id for d in held(broker).values()} == {"m0", "m2", *(d.message_id for d in again)}
    broker.ack(member, [out[0].receipt, out[2].receipt] + [d.receipt for d in again])
    assert held(broker) == {} and broker.consuming.leases.held(member) == 0
    assert [d.message_id for d in broker.fetch(member, 10, 0)] == ["m7", "m8", "m9"]


def test_a_leaving_member_and_a_seek_take_their_receipts_along(broker: Broker) -> None:
    broker.publish("orders", [OutgoingMessage(f"b{n}".encode()) for n in range(8)])
    one = broker.join("g", ["orders"], broadcast=True)
    two = broker.join("g", ["orders"], broadcast=True)
    first, second = broker.fetch(one, 8, 0), broker.fetch(two, 8, 0)
    assert len(held(broker)) == 16
    broker.leave(one)
    assert set(held(broker)) == {d.receipt for d in second}
    broker.ack(two, [d.receipt for d in first])  # receipts of a member gone: stale
    broker.commit(two, {key: 0 for key in broker.assignment(two)})
    assert held(broker) == {} and broker.consuming.leases.held(two) == 0


def test_a_receipt_of_an_earlier_broker_on_the_same_store_acks_nothing(open_broker: Open, tmp_path) -> None:
    broker = open_broker(queues=1)
    broker.publish("orders", messages(4))
    member = broker.join("g", ["orders"])
    stale = [d.receipt for d in broker.fetch(member, 4, 0)]
    broker.close()
    reopened = open_broker(queues=1)
    member = reopened.join("g", ["orders"])
    again = reopened.fetch(member, 4, 0)
    assert [d.message_id for d in again] == [f"m{n}" for n in range(4)]
    assert not set(stale) & {d.receipt for d in again}
    reopened.ack(member, stale)
    assert len(held(reopened)) == 4
    reopened.ack(member, [d.receipt for d in again])
    assert held(reopened) == {} and reopened.pending("g", ["orders"]) == 0


def test_a_batch_published_at_once_is_placed_as_one_by_one(broker: Broker) -> None:
    placed = broker.publish("orders", [OutgoingMessage(b"a", message_id="a"), OutgoingMessage(b"b"),
                                       OutgoingMessage(b"a again", message_id="a"),
                                       OutgoingMessage(b"k", key="customer-7", headers={"h": "v"}),
                                       OutgoingMessage(b"later", deliver_at=1e12)])
    assert placed[2] == replace(placed[0], duplicate=True)
    assert [type(p) for p in placed] == [Placement] * 5 and not any(p.duplicate for p in placed[:2])
    assert [p.message_id for p in placed][:1] == ["a"] and len({p.message_id for p in placed}) == 4
    assert broker.publish("orders", [OutgoingMessage(b"a", message_id="a")]) == [placed[2]]
    with pytest.raises(DeliveryError, match="must be bytes, got str"):
        broker.publish("orders", [OutgoingMessage(b"fine"), OutgoingMessage("text")])  # type: ignore[arg-type]
    member = broker.join("g", ["orders"])
    got = {d.body: d for d in broker.fetch(member, 10, 0)}
    assert sorted(got) == [b"a", b"b", b"k"]  # nothing of the refused batch; the scheduled one waits
    assert dict(got[b"k"].headers) == {"h": "v"} and got[b"k"].key == "customer-7"
