"""A member of a Kafka consumer group in a process of its own, for tests that SIGKILL it.

``python -m tests.transports.test_kafka_child URL GROUP TOPIC COMMIT_FIRST`` fetches,
prints every message as a JSON line ``{"queue", "offset", "id"}``, commits the
first ``COMMIT_FIRST`` messages it got (per queue, the next offset), prints
``{"committed": N}`` once it did, and keeps fetching until it is killed.
"""

from __future__ import annotations

import json
import sys

from backends.transport import open_transport
from backends.types import Message
from tests.transports.kafka_place import SESSION_TIMEOUT


def main(url: str, group: str, topic: str, commit_first: int) -> None:
    transport = open_transport(url, visibility_timeout=SESSION_TIMEOUT)  # the group's: see there
    subscription = transport.subscribe(group, [topic])
    got: list[Message] = []
    committed = False
    while True:
        for message in subscription.fetch(50, 0.5):
            got.append(message)
            print(json.dumps({"queue": message.queue, "offset": message.offset, "id": message.id}), flush=True)
        if not committed and len(got) >= commit_first:
            offsets = {}
            for message in got[:commit_first]:
                offsets[message.ref] = max(offsets.get(message.ref, 0), message.offset + 1)
            subscription.commit(offsets)
            committed = True
            print(json.dumps({"committed": commit_first}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
