"""The engine when the wall clock steps (an NTP correction, a resumed VM) while durations run on.

Leases, member heartbeats and parked messages are timed by the monotonic clock: a step forward
redelivers nothing early and expires no member, a step back holds nothing a dead consumer had.
Due times in the log stay wall time; once read, they are parked on the monotonic clock.
"""

from __future__ import annotations

import pytest

from broker.delivery.values import OutgoingMessage
from broker.store import FakeClock
from tests.broker.delivery.conftest import Open, messages

HOUR = 3600.0


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_a_lease_ends_on_time_whichever_way_the_wall_clock_steps(
    open_broker: Open, clock: FakeClock, step: float
) -> None:
    broker = open_broker(lease=10.0, session_timeout=60.0)
    broker.publish("orders", messages(1))
    member = broker.join("g", ["orders"])
    (first,) = broker.fetch(member, 1, 0)
    clock.step(step)
    clock.advance(9)
    assert broker.fetch(member, 1, 0) == []  # still leased: not redelivered early
    clock.advance(2)  # the consumer died holding it: back once its lease ends, not an hour later
    (again,) = broker.fetch(member, 1, 0)
    assert (again.message_id, again.delivery_count) == (first.message_id, 2)


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_a_silent_member_leaves_after_the_session_timeout_whichever_way_the_wall_clock_steps(
    open_broker: Open, clock: FakeClock, step: float
) -> None:
    broker = open_broker(session_timeout=30.0)
    broker.join("g", ["orders"])
    clock.step(step)
    clock.advance(29)
    assert broker.consuming.has_members("g")
    clock.advance(2)
    assert not broker.consuming.has_members("g")


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_a_nacked_message_comes_back_after_its_delay_whichever_way_the_wall_clock_steps(
    open_broker: Open, clock: FakeClock, step: float
) -> None:
    broker = open_broker()
    broker.publish("orders", messages(1))
    member = broker.join("g", ["orders"])
    (delivery,) = broker.fetch(member, 1, 0)
    broker.nack(member, [delivery.receipt], 5.0)
    assert broker.fetch(member, 1, 0) == []  # its retry copy is read and parked
    clock.step(step)
    clock.advance(4)
    assert broker.fetch(member, 1, 0) == []
    assert broker.next_due("g") == pytest.approx(clock.time() + 1)  # wall time, after the step
    clock.advance(1)
    assert [d.delivery_count for d in broker.fetch(member, 1, 0)] == [2]


def test_a_scheduled_message_read_before_a_step_keeps_its_wait(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker()
    broker.publish("orders", [OutgoingMessage(b"later", message_id="later", deliver_at=clock.time() + 60)])
    member = broker.join("g", ["orders"])
    assert broker.fetch(member, 1, 0) == []
    clock.step(HOUR)
    clock.advance(1)
    assert broker.fetch(member, 1, 0) == []
    clock.step(-2 * HOUR)
    clock.advance(59)
    assert [d.body for d in broker.fetch(member, 1, 0)] == [b"later"]


def test_a_resent_id_is_still_dropped_after_the_wall_clock_steps_forward(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker(dedup_window=600.0)
    (first,) = broker.publish("orders", messages(1))
    clock.step(HOUR)
    clock.advance(1)
    (again,) = broker.publish("orders", messages(1))  # a producer's retry, a second later
    assert again.duplicate and (again.queue, again.offset) == (first.queue, first.offset)
