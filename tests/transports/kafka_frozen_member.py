"""A Kafka group member that is frozen (SIGSTOP) while it holds a batch, for
`tests/transports/test_kafka_rebalance.py`.

``python -m tests.transports.kafka_frozen_member URL GROUP TOPIC COUNT`` fetches
``COUNT`` messages and prints ``{"fetched": COUNT}``; the test freezes it past its
session timeout, lets another member take its partitions and thaws it, then
writes a line. The member finishes half its batch as a worker would (ack, commit
the next offsets), fetches until it hears its partitions are gone and prints
``{"commit": "returned" or "raised: ...", "told": true/false}``.
"""

from __future__ import annotations

import json
import sys

from backends.errors import ReliableError
from backends.transport import open_transport
from backends.transport.base import SubscribeOptions
from backends.types import Message, QueueRef
from tests.transports.kafka_place import SESSION_TIMEOUT

ROUNDS = 60


def main(url: str, group: str, topic: str, count: int) -> None:
    transport = open_transport(url, visibility_timeout=SESSION_TIMEOUT)
    told: list[QueueRef] = []
    subscription = transport.subscribe(group, [topic], SubscribeOptions(on_revoke=told.extend))
    got: list[Message] = []
    while len(got) < count:
        got += subscription.fetch(count - len(got), 0.5)
    print(json.dumps({"fetched": len(got)}), flush=True)
    sys.stdin.readline()  # frozen, then thawed: the handler is done with the first half
    half = got[: count // 2]
    subscription.ack(half)
    try:
        subscription.commit({half[0].ref: half[-1].offset + 1})
        outcome = "returned"
    except ReliableError as exc:
        outcome = f"raised: {exc}"
    for _ in range(ROUNDS):
        if told:
            break
        subscription.fetch(10, 0.5)
    print(json.dumps({"commit": outcome, "told": bool(told)}), flush=True)
    subscription.close()
    transport.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
