"""The broker in process: produce and consume+ack per second, next to the store and Redis Streams.

One run, 256-byte bodies, batches of 500:

  store append       `MessageStore.append` alone (the floor under produce)
  broker produce     `Broker.publish` (queue selection, de-duplication window, append)
  broker consume+ack one member: `fetch(500)`, `ack(receipts)` until the topic is drained
  redis produce      XADD, 500 per pipeline (redis-py)
  redis consume+ack  XREADGROUP COUNT 500, XACK of the ids

with the store's ``async`` and ``sync`` flush policies (Redis here keeps nothing
on disk: its numbers are an upper bound for it). The load average is printed
before and after: on a busy machine compare runs of the same minute.

``--consume-only R`` fills one broker and measures consume+ack alone, R times
(a fresh group each time), in wall-clock and in process CPU time: the engine
without Redis or the other rows in the way.

    python -m benchmarks.broker_embedded [--messages N] [--consume-only R]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable

import structlog

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
        consumed = rate(count, lambda: consume(broker, "g", count))
        broker.close()
        return produce, consumed


def consume(broker: Broker, group: str, count: int) -> None:
    """One member of a new ``group`` fetches 500 and acks them, until ``count`` are done."""
    member = broker.join(group, ["bench"])
    done = 0
    while done < count:
        deliveries = broker.fetch(member, BATCH, 1.0)
        broker.ack(member, [d.receipt for d in deliveries])
        done += len(deliveries)


def consume_only(count: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        broker = Broker(folder, DeliveryConfig(queues=4, prefetch=BATCH * 2))
        batch = [OutgoingMessage(BODY) for _ in range(BATCH)]
        for _ in range(count // BATCH):
            broker.publish("bench", batch)
        for number in range(rounds):
            began, cpu = time.perf_counter(), time.process_time()
            consume(broker, f"g{number}", count)
            print(f"consume+ack {count / (time.perf_counter() - began):>12,.0f} msg/s"
                  f"  {count / (time.process_time() - cpu):>12,.0f} per CPU second")
        broker.close()


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
    parser.add_argument("--consume-only", type=int, default=0, metavar="ROUNDS")
    arguments = parser.parse_args()
    count = arguments.messages // BATCH * BATCH
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(f"{count} messages of 256 bytes, batches of {BATCH}, load average {load()}\n")
    if arguments.consume_only:
        consume_only(count, arguments.consume_only)
        print(f"load average {load()}")
        return
    print(f"{'':<22}{'produce':>12}{'consume+ack':>14}   msg/s")
    redis_produce, redis_consume = redis_rates(count)
    for flush in ("async", "sync"):
        print(f"{'store append ' + flush:<22}{store_append(count, flush):>12,.0f}{'':>14}")
        produce, consumed = broker_rates(count, flush)
        print(f"{'broker ' + flush:<22}{produce:>12,.0f}{consumed:>14,.0f}"
              f"   consume+ack {consumed / redis_consume:.2f}x Redis")
    print(f"{'redis streams':<22}{redis_produce:>12,.0f}{redis_consume:>14,.0f}")
    print(f"\nload average {load()}")
    print("targets: produce >= 100,000/s, consume+ack >= 50,000/s (async), consume+ack >= 1.5x Redis")


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


if __name__ == "__main__":
    main()
