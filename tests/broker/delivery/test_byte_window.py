"""A member's byte window counts the messages it holds unacknowledged (`broker.delivery.sizes`), through every end of a delivery.

The server bounds what one connection holds by it (``max_unacked_bytes``): a window that drifted
up would stop a connection for good, one that drifted down would let it hold more than the bound.
Each way a delivery ends (ack, nack, dead letter, give back, lease expiry, a seek, the member
leaving) gives its bytes back; DELIVERED and extend keep them (the body is still held).
"""

from __future__ import annotations

from broker.delivery.config import DeliveryConfig
from broker.delivery.cursor import ByteWindow
from broker.delivery.engine import Broker
from broker.delivery.sizes import delivery_size
from broker.delivery.values import OutgoingMessage
from broker.store.clock import FakeClock


def test_every_end_of_a_delivery_gives_its_bytes_back(tmp_path, unique) -> None:
    clock = FakeClock()
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1, lease=10, session_timeout=1000), clock=clock)
    try:
        broker.publish(unique, [OutgoingMessage(b"x" * (n + 1)) for n in range(10)])
        window = ByteWindow()
        member = broker.join(unique, [unique], prefetch=100)
        broker.consuming.share_window(member, window)
        held = broker.fetch(member, 6, 0)
        assert window.held == sum(map(delivery_size, held)) == 1 + 2 + 3 + 4 + 5 + 6 + 6 * len(held[0].message_id)
        broker.ack(member, [held[0].receipt, held[2].receipt])  # 1, 3: not in a row
        assert window.held == sum(map(delivery_size, (held[1], held[3], held[4], held[5])))
        broker.delivered(member, [held[1].receipt])
        broker.extend(member, [held[3].receipt])
        assert window.held == sum(map(delivery_size, (held[1], held[3], held[4], held[5])))
        broker.nack(member, [held[1].receipt], 0)
        broker.dead_letter(member, [held[3].receipt], "poison")
        broker.release(member, [held[4].receipt])
        assert window.held == delivery_size(held[5])
        clock.advance(11)  # the lease of 6 ends
        again = broker.fetch(member, 100, 0)  # its sweep lapses the lease; 5, 6, 7-10 and 2's retry copy
        assert window.held == sum(map(delivery_size, again))
        broker.commit(member, {(unique, 0): 10})  # a seek lets go of what it held there
        assert window.held == sum(delivery_size(d) for d in again if d.topic != unique)
        broker.leave(member)
        assert window.held == 0
    finally:
        broker.close()


def test_a_member_is_handed_nothing_while_its_window_is_full(tmp_path, unique) -> None:
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1))
    try:
        broker.publish(unique, [OutgoingMessage(b"x" * 100) for _ in range(10)])
        window = ByteWindow(limit=250)
        member = broker.join(unique, [unique], prefetch=100)
        broker.consuming.share_window(member, window)
        held = []
        while got := broker.fetch(member, 100, 0):  # a fetch reads within the room left...
            held += got
        size = delivery_size(held[0])  # the body's 100 bytes and the message id's
        assert 250 <= window.held == size * len(held) <= 250 + size  # ...the first of one whatever its size
        broker.ack(member, [held[0].receipt])
        assert broker.fetch(member, 100, 0)
    finally:
        broker.close()
