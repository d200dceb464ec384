"""The broker in process: produce and consume+ack per second, next to the store and Redis Streams.

One run, 256-byte bodies, batches of 500:

  store append       `MessageStore.append` alone (the floor under produce)
  broker produce     `Broker.publish` (queue selection, de-duplication window, append)
  broker consume+ack one member: `fetch(500)`, `ack(receipts)` until the topic is drained
  redis produce      XADD, 500 per pipeline (redis-py)
  redis consume+ack  XREADGROUP COUNT 500, XACK of the ids

with the store's ``async`` and ``sync`` flush policies (Redis here keeps nothing
on disk: its numbers are an upper bound for it).

    python -m benchmarks.broker_embedded [--messages N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.store import MessageStore, Record, StoreConfig

BODY = os.urandom(256)
BATCH = 500
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def rate(count: int, run: Callable[[], None]) -> float:
    began = time.perf_counter()
    run()
    return count / (time.perf_counter() - began)


def store_append(count: int, flush: str) -> float:
    with tempfile.TemporaryDirectory() as folder, MessageStore(folder, StoreConfig(flush=flush)) as store:
        records = [Record("bench", 0, BODY) for _ in range(BATCH)]
        return rate(count, lambda: [store.append(records) for _ in range(count // BATCH)])


def broker_rates(count: int, flush: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as folder:
        broker = Broker(folder, DeliveryConfig(queues=4, prefetch=BATCH * 2), store_config=StoreConfig(flush=flush))
        batch = [OutgoingMessage(BODY) for _ in range(BATCH)]
        produce = rate(count, lambda: [broker.publish("bench", batch) for _ in range(count // BATCH)])
        member = broker.join("g", ["bench"])

        def consume() -> None:
            done = 0
            while done < count:
                deliveries = broker.fetch(member, BATCH, 1.0)
                broker.ack(member, [d.receipt for d in deliveries])
                done += len(deliveries)

        consumed = rate(count, consume)
        broker.close()
        return produce, consumed


def redis_rates(count: int) -> tuple[float, float]:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    stream = f"bench-{uuid.uuid4().hex[:8]}"

    def produce() -> None:
        for _ in range(count // BATCH):
            pipe = client.pipeline(transaction=False)
            for _ in range(BATCH):
                pipe.xadd(stream, {"body": BODY})
            pipe.execute()

    produced = rate(count, produce)
    client.xgroup_create(stream, "g", id="0")

    def consume() -> None:
        done = 0
        while done < count:
            for _, entries in client.xreadgroup("g", "c", {stream: ">"}, count=BATCH):
                client.xack(stream, "g", *[entry_id for entry_id, _ in entries])
                done += len(entries)

    consumed = rate(count, consume)
    client.delete(stream)
    return produced, consumed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    count = parser.parse_args().messages // BATCH * BATCH
    print(f"{count} messages of 256 bytes, batches of {BATCH}\n")
    print(f"{'':<22}{'produce':>12}{'consume+ack':>14}   msg/s")
    redis_produce, redis_consume = redis_rates(count)
    for flush in ("async", "sync"):
        print(f"{'store append ' + flush:<22}{store_append(count, flush):>12,.0f}{'':>14}")
        produce, consume = broker_rates(count, flush)
        print(f"{'broker ' + flush:<22}{produce:>12,.0f}{consume:>14,.0f}"
              f"   consume+ack {consume / redis_consume:.2f}x Redis")
    print(f"{'redis streams':<22}{redis_produce:>12,.0f}{redis_consume:>14,.0f}")
    print("\ntargets: produce >= 100,000/s, consume+ack >= 50,000/s (async), consume+ack >= 1.5x Redis")


if __name__ == "__main__":
    main()
