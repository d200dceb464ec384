"""Acks of whole fetches, of parts of them, and of receipts in any order: the receipt table
stays in step with what the cursors hold, and the prefetch window with both."""

from __future__ import annotations

import random

from broker.delivery.engine import Broker
from broker.delivery.values import Delivery, OutgoingMessage, deliveries
from broker.store import FakeClock
from tests.broker.delivery.conftest import Open, messages


def held(broker: Broker) -> dict[str, Delivery]:
    """What the cursors hold, by receipt (checked against the broker's receipt table)."""
    found = {h.delivery.receipt: h.delivery for g in broker.group_table.values()
             for c in g.all_cursors() for h in c.held.values()}
    assert {r: h.delivery for r, h in broker.receipts.items()} == found
    return found


def test_many_deliveries_equal_the_constructor() -> None:
    made = deliveries(3, {"topic": "t", "queue": 1, "key": "", "tag": "x", "delivery_count": 1},
                      {"receipt": ["a", "b", "c"], "offset": [4, 5, 6], "message_id": ["i", "j", "k"],
                       "body": [b"1", b"2", b"3"], "headers": [{}, {"h": "v"}, {}],
                       "published_at": [1.0, 2.0, 3.0]})
    assert made == [Delivery(r, "t", 1, o, i, b, "", "x", h, 1, p) for r, o, i, b, h, p in zip(
        "abc", (4, 5, 6), "ijk", (b"1", b"2", b"3"), ({}, {"h": "v"}, {}), (1.0, 2.0, 3.0))]


def test_acks_in_any_order_and_in_parts_finish_exactly_what_they_name(open_broker: Open) -> None:
    broker = open_broker(queues=3, prefetch=100, read_batch=7)
    broker.publish("orders", messages(90))
    member = broker.join("g", ["orders"])
    rng = random.Random(7)
    done: set[str] = set()
    while out := broker.fetch(member, 40, 0):
        assert len(held(broker)) == len(out) and broker.held_count[member] == len(out)
        receipts = [d.receipt for d in out]
        rng.shuffle(receipts)
        first, rest = receipts[: len(receipts) // 3], receipts[len(receipts) // 3 :]
        broker.ack(member, first + first[:2] + ["1:0:9", "junk"])  # repeats and strangers ignored
        assert set(held(broker)) == set(rest) and broker.held_count[member] == len(rest)
        broker.ack(member, rest)
        done |= {d.message_id for d in out}
        assert held(broker) == {} and broker.held_count[member] == 0
    assert done == {f"m{n}" for n in range(90)} and broker.pending("g", ["orders"]) == 0
    assert [c.done for c in broker.group_table["g"].cursors.values()] == [set()] * 4


def test_delivered_and_extend_of_part_of_a_fetch(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker(queues=1, prefetch=6, lease=10.0)
    broker.publish("orders", messages(10))
    member = broker.join("g", ["orders"])
    out = broker.fetch(member, 6, 0)
    broker.delivered(member, [out[0].receipt, out[1].receipt, out[1].receipt])
    assert broker.held_count[member] == 4
    assert [d.message_id for d in broker.fetch(member, 6, 0)] == ["m6", "m7"]
    clock.advance(6)
    broker.extend(member, [out[0].receipt, out[2].receipt])
    clock.advance(6)  # the others' leases ended; m0 and m2 are still out
    again = broker.fetch(member, 10, 0)  # m2 counts in the window, m0 (DELIVERED) does not
    assert [d.message_id for d in again] == ["m1", "m3", "m4", "m5", "m6"]
    assert {d.message_id for d in held(broker).values()} == {"m0", "m2", *(d.message_id for d in again)}
    broker.ack(member, [out[0].receipt, out[2].receipt] + [d.receipt for d in again])
    assert held(broker) == {} and broker.held_count[member] == 0
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
    assert held(broker) == {} and broker.held_count[two] == 0
