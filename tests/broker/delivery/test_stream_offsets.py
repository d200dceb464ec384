"""A stream processor's offsets (`commit_group`): never back, and never past a queue's end.

An offset past the end would make the group skip every message written up to
there, silently: it is refused, naming the queues, and the saved offsets stay.
"""

from __future__ import annotations

import pytest

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.errors import DeliveryError
from broker.store import StoreConfig
from broker.store.clock import FakeClock


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


def test_a_group_whose_members_all_left_takes_a_position_readers_commit(tmp_path, unique) -> None:
    """It was refused until the broker restarted (the group stayed in memory). A member joining
    afterwards starts at the commit, and what its group acked above it stays done."""
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1))
    try:
        broker.publish(unique, [OutgoingMessage(f"m{n}".encode()) for n in range(6)])
        member = broker.join("consumers", [unique], prefetch=10)
        fetched = broker.fetch(member, 6, 0)
        broker.ack(member, [d.receipt for d in fetched if d.offset in (0, 4)])  # 4 acked ahead
        with pytest.raises(DeliveryError, match="has live members"):
            broker.commit_group("consumers", unique, [3])
        broker.leave(member)  # 1, 2, 3, 5 ready again
        broker.commit_group("consumers", unique, [3])
        assert broker.group_offsets("consumers", unique) == [3]
        again = broker.join("consumers", [unique], prefetch=10)
        redelivered = broker.fetch(again, 10, 0)
        assert [d.body for d in redelivered] == [b"m3", b"m5"]
        broker.ack(again, [d.receipt for d in redelivered])
        broker.leave(again)
        broker.commit_group("consumers", unique, [0])  # never back
        assert broker.group_offsets("consumers", unique) == [6]
    finally:
        broker.close()


def test_a_group_whose_members_went_silent_takes_a_commit(tmp_path, unique) -> None:
    """Members silent past the session timeout no longer count, though no fetch swept them out."""
    clock = FakeClock()
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1, session_timeout=10), clock=clock)
    try:
        broker.publish(unique, [OutgoingMessage(f"m{n}".encode()) for n in range(3)])
        member = broker.join("consumers", [unique])
        assert len(broker.fetch(member, 1, 0)) == 1
        clock.advance(5)
        with pytest.raises(DeliveryError, match="has live members"):
            broker.commit_group("consumers", unique, [2])
        clock.advance(6)
        broker.commit_group("consumers", unique, [2])
        again = broker.join("consumers", [unique])
        assert [d.body for d in broker.fetch(again, 10, 0)] == [b"m2"]
    finally:
        broker.close()


def test_a_position_readers_commit_outlives_a_members_seek_in_the_ack_journal(tmp_path, unique) -> None:
    """Under ``sync`` the ack journal's last seek of a queue is taken over the offset book at a
    restart: a member's ``commit`` to 1, then a position reader's commit to 4, came back as 1."""
    config = DeliveryConfig(queues=1)
    with Broker(tmp_path / "broker", config, store_config=StoreConfig(flush="sync")) as broker:
        broker.publish(unique, [OutgoingMessage(f"m{n}".encode()) for n in range(6)])
        member = broker.join("consumers", [unique])
        broker.commit(member, {(unique, 0): 1})  # offsets kept by the consumer: a seek
        acked = [d for d in broker.fetch(member, 6, 0) if d.offset == 5]
        broker.ack(member, [d.receipt for d in acked])  # acked above the reader's commit
        broker.leave(member)
        broker.commit_group("consumers", unique, [4])
    with Broker(tmp_path / "broker", config, store_config=StoreConfig(flush="sync")) as broker:
        assert broker.group_offsets("consumers", unique) == [4]
        member = broker.join("consumers", [unique])
        assert [d.body for d in broker.fetch(member, 10, 0)] == [b"m4"]  # m5 stays acked
