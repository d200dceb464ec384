"""Messages per second on `nats://`: the framework next to nats-py's own consume+ack loop, one run.

Workload (handler_overhead's): unique tokens plus 10% duplicates, shuffled,
one INSERT per new token into PostgreSQL. Both rows read the same kind of
stream on the same server:

  (raw)       nats-py, a durable pull consumer: ``fetch(500)``, ``+ACK`` each (no store)
  (framework) ``@app.handler`` in batch mode (``batch=500``), 4 threads, idempotency on
              (PostgreSQL store + Redis cache), ``App.run(until_idle=True)``

    python -m benchmarks.transports_nats [--count N]

`benchmarks/transports.py` takes ``raw`` for its NATS row and runs the
framework rows through the same code as every transport.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import nats
from nats.js.api import AckPolicy, ConsumerConfig
from sqlalchemy import text

from backends.transport.nats_layout import Layout
from backends.transport.nats_transport import NatsTransport
from backends.types import OutgoingMessage
from benchmarks.handler_overhead import (
    DATABASE_URL,
    REDIS_URL,
    check,
    engine_for,
    setup_tables,
    workload,
)
from reliable import App, Message
from reliable.settings import Settings

NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
BATCH = 500
THREADS = 4


def load(namespace: str, topic: str, payloads: list[bytes]) -> None:
    with NatsTransport(NATS_URL, namespace=namespace) as transport:
        for i in range(0, len(payloads), BATCH):
            transport.publish(topic, [OutgoingMessage(p) for p in payloads[i : i + BATCH]])


def purge(namespace: str) -> None:
    with NatsTransport(NATS_URL, namespace=namespace) as transport:
        transport.purge()


def raw(count: int) -> float:
    """nats-py alone: pull 500 at a time from a durable consumer and ack each."""
    namespace, topic = f"b{uuid.uuid4().hex[:8]}", "bench"
    load(namespace, topic, workload(count))
    layout = Layout(namespace)

    async def consume() -> float:
        client = await nats.connect(NATS_URL)
        js = client.jetstream()
        await js.add_consumer(layout.stream(topic), ConsumerConfig(
            durable_name="raw", ack_policy=AckPolicy.EXPLICIT, filter_subject=layout.subject(topic)))
        pull = await js.pull_subscribe_bind("raw", layout.stream(topic))
        started, seen = time.perf_counter(), 0
        while seen < count:
            for message in await pull.fetch(BATCH, timeout=5):
                await message.ack()
                seen += 1
        await client.flush()
        elapsed = time.perf_counter() - started
        await client.close()
        return count / elapsed

    try:
        return asyncio.run(consume())
    finally:
        purge(namespace)


def framework(count: int) -> float:
    """The framework on nats://: batch mode, 4 threads, PostgreSQL + Redis idempotency."""
    namespace, table = f"b{uuid.uuid4().hex[:8]}", f"bench_{uuid.uuid4().hex[:8]}"
    engine = engine_for(DATABASE_URL)
    setup_tables(engine, table)
    payloads = workload(count)
    load(namespace, "bench", payloads)
    env = {"RELIABLE_STORE__URL": DATABASE_URL, "RELIABLE_CACHE__URL": REDIS_URL,
           "RELIABLE_TRANSPORT__URL": f"{NATS_URL}?namespace={namespace}",
           "RELIABLE_LOG__LEVEL": "warning", "RELIABLE_WORKER__PREFETCH": str(BATCH)}
    app = App(Settings.load(None, env=env))
    insert = text(f"insert into {table} values (:token, :amount)")

    @app.handler("bench", group=table, token="body.token", batch=BATCH, concurrency=THREADS)
    def handle(messages: list[Message], tx) -> None:
        tx.execute(insert, [m.body for m in messages])

    try:
        started = time.perf_counter()
        app.run(until_idle=True)
        rate = count / (time.perf_counter() - started)
        check(engine, table, payloads)
        return rate
    finally:
        app.close()
        purge(namespace)
        with engine.begin() as conn:
            conn.execute(text(f"drop table if exists {table}"))
        engine.dispose()


def rows(count: int = 20_000) -> list[dict]:
    """One row per measurement: transport, what ran, messages per second."""
    return [
        {"transport": "nats", "run": "raw nats-py pull fetch(500) + ack", "msgs_per_s": raw(count)},
        {"transport": "nats", "run": f"framework batch={BATCH} threads={THREADS} PostgreSQL+Redis",
         "msgs_per_s": framework(count)},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20_000)
    args = parser.parse_args()
    print(f"{'transport':<10} {'run':<55} {'msg/s':>10}")
    for row in rows(args.count):
        print(f"{row['transport']:<10} {row['run']:<55} {row['msgs_per_s']:>10,.0f}")


if __name__ == "__main__":
    main()
