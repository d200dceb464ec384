"""200,000 persistent messages, consumers that connect, take a few and disconnect, over and over.

ActiveMQ 5.1 lost messages in exactly this scenario: its paging from disk went
on reading when memory was full and its duplicate audit then dropped them.
Here a member is handed at most its prefetch window, read from the store as
it is asked for (a small ``read_batch``): every message must be received,
and none twice except those a member held unacknowledged when it left.
"""

from __future__ import annotations

import random
import resource

from broker.delivery.values import OutgoingMessage
from tests.broker.delivery.conftest import Open

COUNT = 200_000


def test_connect_take_a_few_disconnect_loses_nothing(open_broker: Open) -> None:
    broker = open_broker(queues=1, prefetch=64, read_batch=16, store_flush="async")
    body = b"x" * 64
    for start in range(0, COUNT, 5_000):
        broker.publish("orders", [OutgoingMessage(body, message_id=f"m{n}")
                                  for n in range(start, start + 5_000)])
    rng = random.Random(5)
    received: dict[str, int] = {}
    unacked_at_leave: set[str] = set()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    while len(received) < COUNT:
        member = broker.join("g", ["orders"])
        deliveries = broker.fetch(member, rng.randint(1, 64), 0)
        keep = deliveries[: len(deliveries) - (rng.random() < 0.2)]  # now and then one is left unacked
        broker.ack(member, [d.receipt for d in keep])
        unacked_at_leave.update(d.message_id for d in deliveries[len(keep):])
        broker.leave(member)
        for delivery in deliveries:
            received[delivery.message_id] = received.get(delivery.message_id, 0) + 1
        held = sum(len(c.held) + len(c.ready) for g in broker.consuming.membership.group_table.values() for c in g.all_cursors())
        assert held <= 64  # never more than one window out of the store
    assert set(received) == {f"m{n}" for n in range(COUNT)}
    twice = {message_id for message_id, times in received.items() if times > 1}
    assert twice <= unacked_at_leave  # redelivered only what was not acknowledged
    assert broker.pending("g", ["orders"]) == 0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    print(f"peak RSS grew {grown_mib:.0f} MiB while consuming {COUNT} messages")
