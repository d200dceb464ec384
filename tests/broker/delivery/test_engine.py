"""The delivery engine's promises, one by one, on a fake clock."""

from __future__ import annotations

import pytest

from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.errors import DeliveryError, InvalidNameError, UnknownMemberError
from broker.store import FakeClock
from tests.broker.delivery.conftest import Open, drain, messages


def held_members(broker: Broker) -> dict[tuple[str, int], set[str]]:
    return {key: cursor.holders()
            for group in broker.consuming.membership.group_table.values() for key, cursor in group.cursors.items()}


def test_keyed_messages_keep_one_queue_in_order_and_a_resent_id_is_dropped(broker: Broker) -> None:
    placed = broker.publish("orders", messages(5, key="customer-7"))
    assert len({p.queue for p in placed}) == 1 and [p.offset for p in placed] == list(range(5))
    again = broker.publish("orders", [OutgoingMessage(b"m3", key="customer-7", message_id="m3")])
    assert again[0].duplicate and again[0].offset == 3
    member = broker.join("g", ["orders"])
    assert [d.message_id for d in drain(broker, member)] == [f"m{n}" for n in range(5)]


def test_a_nacked_message_comes_back_after_each_delay_counted_then_is_dead_lettered_once(
    open_broker: Open, clock: FakeClock
) -> None:
    broker = open_broker(max_deliveries=4)
    body = b"\x00binary\xffbody\x00"
    broker.publish("orders", [OutgoingMessage(body, key="k", message_id="poison")])
    member = broker.join("g", ["orders"])
    seen = []
    for delay in (1.0, 2.0, 4.0, 8.0):
        (delivery,) = broker.fetch(member, 10, 0)
        seen.append((delivery.delivery_count, clock.time()))
        broker.nack(member, [delivery.receipt], delay)
        clock.advance(delay - 0.5)
        assert broker.fetch(member, 10, 0) == []  # not before its delay
        clock.advance(0.5)
    assert [count for count, _ in seen] == [1, 2, 3, 4]
    assert broker.fetch(member, 10, 0) == []  # the 4th nack reached max_deliveries: dead-lettered
    (letter,) = broker.dlq_list("g")
    assert letter.body == body and letter.message_id == "poison" and letter.key == "k"
    assert letter.headers["x-dlq-cause"].startswith("delivered 4 times")
    assert letter.headers["x-origin-topic"] == "orders"
    assert broker.pending("g", ["orders"]) == 0
    assert all(not holders for holders in held_members(broker).values())


def test_dead_letter_keeps_the_cause_and_replay_reaches_the_group_only(broker: Broker) -> None:
    broker.publish("orders", messages(2))
    billing, shipping = broker.join("billing", ["orders"]), broker.join("shipping", ["orders"])
    assert len(drain(broker, shipping)) == 2
    first, second = broker.fetch(billing, 10, 0)
    broker.dead_letter(billing, [first.receipt], "ValueError: bad amount")
    broker.ack(billing, [second.receipt])
    assert [d.headers["x-dlq-cause"] for d in broker.dlq_list("billing")] == ["ValueError: bad amount"]
    assert broker.dlq_replay("billing") == 1 and broker.dlq_list("billing") == []
    (replayed,) = broker.fetch(billing, 10, 0)
    assert (replayed.body, replayed.headers["x-origin-topic"]) == (first.body, "orders")
    assert broker.fetch(shipping, 10, 0) == []  # shipping is not disturbed
    broker.dead_letter(billing, [replayed.receipt], "again")
    assert broker.dlq_purge("billing") == 1 and broker.dlq_list("billing") == []


def test_a_lease_that_ends_redelivers_counted_and_a_silent_member_loses_its_queues(
    open_broker: Open, clock: FakeClock
) -> None:
    broker = open_broker(lease=10.0, session_timeout=30.0, queues=2)
    broker.publish("orders", messages(4))
    quiet, busy = broker.join("g", ["orders"]), broker.join("g", ["orders"])
    taken = broker.fetch(quiet, 10, 0)
    assert taken and all(d.delivery_count == 1 for d in taken)
    clock.advance(11)
    for _ in range(3):  # busy keeps calling; quiet says nothing
        drain(broker, busy)
        clock.advance(11)
    with pytest.raises(UnknownMemberError):
        broker.fetch(quiet, 1, 0)
    assert broker.pending("g", ["orders"]) == 0
    assert len(broker.assignment(busy)) == 3  # both queues of orders and the retry queue


def test_stale_receipts_are_ignored_and_acks_are_final(broker: Broker, clock: FakeClock) -> None:
    broker.publish("orders", messages(1))
    member = broker.join("g", ["orders"])
    (delivery,) = broker.fetch(member, 1, 0)
    broker.ack(member, [delivery.receipt, delivery.receipt, "999:0:1", "junk"])
    broker.nack(member, [delivery.receipt], 0)  # already done: nothing happens
    assert broker.pending("g", ["orders"]) == 0 and broker.fetch(member, 1, 0) == []


def test_tags_a_member_does_not_want_are_consumed_unseen(broker: Broker) -> None:
    broker.publish("orders", messages(3, prefix="a", tag="created") + messages(2, prefix="b", tag="paid"))
    member = broker.join("g", ["orders"], tags=["paid"])
    assert sorted(d.message_id for d in drain(broker, member)) == ["b0", "b1"]
    assert broker.pending("g", ["orders"]) == 0  # UNMATCHED counts as consumed


def test_a_scheduled_message_waits_for_its_time(broker: Broker, clock: FakeClock) -> None:
    broker.publish("orders", [OutgoingMessage(b"later", message_id="later", deliver_at=clock.time() + 60)])
    member = broker.join("g", ["orders"])
    assert broker.fetch(member, 1, 0) == [] and broker.next_due("g") == clock.time() + 60
    clock.advance(60)
    assert [d.body for d in broker.fetch(member, 1, 0)] == [b"later"]


def test_broadcasting_members_each_get_everything(broker: Broker) -> None:
    broker.publish("news", messages(6))
    first = broker.join("readers", ["news"], broadcast=True)
    second = broker.join("readers", ["news"], broadcast=True)
    assert len(drain(broker, first)) == len(drain(broker, second)) == 6
    with pytest.raises(DeliveryError, match="broadcasting"):
        broker.join("readers", ["news"])


def test_committed_offsets_survive_a_restart_and_only_unacked_work_comes_back(
    open_broker: Open, tmp_path
) -> None:
    broker = open_broker(queues=1)
    broker.publish("orders", messages(10))
    member = broker.join("g", ["orders"])
    deliveries = broker.fetch(member, 10, 0)
    broker.ack(member, [d.receipt for d in deliveries[:6]])
    broker.close()
    reopened = open_broker(queues=1)
    again = drain(reopened, reopened.join("g", ["orders"]))
    assert [d.message_id for d in again] == [f"m{n}" for n in range(6, 10)]


def test_prefetch_bounds_what_a_member_holds(open_broker: Open) -> None:
    broker = open_broker(prefetch=3, queues=1)
    broker.publish("orders", messages(10))
    member = broker.join("g", ["orders"])
    first = broker.fetch(member, 10, 0)
    assert len(first) == 3 and broker.fetch(member, 10, 0) == []
    broker.ack(member, [first[0].receipt])
    assert len(broker.fetch(member, 10, 0)) == 1


def test_bad_names_and_arguments_are_named(broker: Broker) -> None:
    with pytest.raises(InvalidNameError, match="%RETRY%"):
        broker.publish("%RETRY%g", messages(1))
    with pytest.raises(InvalidNameError, match="topic name ''"):
        broker.publish("", messages(1))
    with pytest.raises(DeliveryError, match="bytes"):
        broker.publish("t", [OutgoingMessage("text")])  # type: ignore[arg-type]
    with pytest.raises(DeliveryError, match="at least one topic"):
        broker.join("g", [])
    with pytest.raises(UnknownMemberError, match="nobody"):
        broker.fetch("nobody", 1, 0)


def test_delivered_acks_widen_the_prefetch_window_but_keep_the_lease(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker(prefetch=2, queues=1, lease=10.0)
    broker.publish("orders", messages(5))
    member = broker.join("g", ["orders"])
    first = broker.fetch(member, 10, 0)
    assert len(first) == 2 and broker.fetch(member, 10, 0) == []
    broker.delivered(member, [d.receipt for d in first])  # received, not done
    second = broker.fetch(member, 10, 0)
    assert [d.message_id for d in second] == ["m2", "m3"]
    clock.advance(11)  # the DELIVERED ones are still leased: they come back when the lease ends
    again = broker.fetch(member, 10, 0)
    assert {d.message_id for d in again} >= {"m0", "m1"} and all(
        d.delivery_count == 2 for d in again if d.message_id in ("m0", "m1"))


def test_a_new_group_can_start_at_a_time(broker: Broker, clock: FakeClock) -> None:
    broker.publish("orders", messages(3, prefix="old"))
    clock.advance(60)
    since = clock.time()
    broker.publish("orders", messages(2, prefix="new"))
    member = broker.join("late", ["orders"], from_time=since)
    assert sorted(d.message_id for d in drain(broker, member)) == ["new0", "new1"]


def test_ordered_consumption_holds_a_queue_behind_a_failing_message(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker(queues=1)
    broker.publish("orders", messages(4, key="customer-1"))
    member = broker.join("g", ["orders"], ordered=True)
    (first,) = broker.fetch(member, 10, 0)  # one message of the queue at a time
    assert first.message_id == "m0" and broker.fetch(member, 10, 0) == []
    broker.nack(member, [first.receipt], 5.0)  # fails: retried in place, the queue waits
    assert broker.fetch(member, 10, 0) == []
    clock.advance(5)
    (retried,) = broker.fetch(member, 10, 0)
    assert (retried.message_id, retried.delivery_count) == ("m0", 2)
    order = [retried.message_id]
    broker.ack(member, [retried.receipt])
    while deliveries := broker.fetch(member, 10, 0):
        order += [d.message_id for d in deliveries]
        broker.ack(member, [d.receipt for d in deliveries])
    assert order == ["m0", "m1", "m2", "m3"]
    with pytest.raises(DeliveryError, match="ordered"):
        broker.join("g", ["orders"])  # a member must consume the group's way


def test_a_resent_id_is_dropped_after_a_restart_within_the_window(open_broker: Open, tmp_path) -> None:
    first = open_broker(tmp_path / "b")
    [placed] = first.publish("orders", [OutgoingMessage(b"once", message_id="order-1")])
    first.close()
    again = open_broker(tmp_path / "b")  # the in-memory window is empty: the store's id index answers
    assert not again.publishing.window_covers("orders") and again.publishing.window_covers("invoices")
    [resent] = again.publish("orders", [OutgoingMessage(b"once", message_id="order-1")])
    assert resent.duplicate and (resent.queue, resent.offset) == (placed.queue, placed.offset)
    [fresh] = again.publish("invoices", [OutgoingMessage(b"new topic", message_id="order-1")])
    assert not fresh.duplicate  # an id is unique per topic
    member = again.join("g", ["orders"])
    assert [d.body for d in drain(again, member)] == [b"once"]
