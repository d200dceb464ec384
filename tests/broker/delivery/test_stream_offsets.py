"""A stream processor's offsets (`commit_group`): never back, and never past a queue's end.

An offset past the end would make the group skip every message written up to
there, silently: it is refused, naming the queues, and the saved offsets stay.
"""

from __future__ import annotations

import pytest

from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.errors import DeliveryError


def test_commit_group_moves_forward_within_the_queues_only(tmp_path, unique) -> None:
    broker = Broker(tmp_path / "broker")
    try:
        broker.publish(unique, [OutgoingMessage(f"m{n}".encode(), queue=0) for n in range(3)])
        ends = [end for _, end in broker.queue_offsets(unique)]
        assert ends[0] == 3
        broker.commit_group("spark", unique, ends)
        assert broker.group_offsets("spark", unique) == ends
        with pytest.raises(DeliveryError, match=r"offsets \(queue, offset, end\) \[\(0, 1000000000, 3\)\]"):
            broker.commit_group("spark", unique, [10**9, *ends[1:]])
        with pytest.raises(DeliveryError, match="not between 0"):
            broker.commit_group("spark", unique, [-1, *ends[1:]])
        broker.commit_group("spark", unique, [0] * len(ends))  # never back
        assert broker.group_offsets("spark", unique) == ends
    finally:
        broker.close()


def test_a_group_its_members_consumed_keeps_broker_offsets_after_the_last_one_left(tmp_path, unique) -> None:
    """Its offsets live with its in-memory state until the broker restarts: the error says so
    (it said the group had live members, when none was left)."""
    broker = Broker(tmp_path / "broker")
    try:
        broker.publish(unique, [OutgoingMessage(b"m", queue=0)])
        broker.leave(broker.join("consumers", [unique]))
        ends = [end for _, end in broker.queue_offsets(unique)]
        with pytest.raises(DeliveryError, match="was joined by members since the broker started"):
            broker.commit_group("consumers", unique, ends)
    finally:
        broker.close()
