"""Handler throughput per transport next to the transport's own consume+ack rate, in one run.

The same workload on every transport: ``--messages`` JSON messages (unique
tokens plus 10% duplicates), each handled by one INSERT into PostgreSQL,
idempotency on (PostgreSQL store + Redis cache):

  raw          the transport's own client: read and ack every message, nothing else
  framework/4  ``@app.handler`` per message, 4 handler threads (key-ordered dispatch)
  batch/500    ``@app.handler(batch=500)``: one transaction and one cache round trip per batch

Transports: Redis Streams and Kafka (librdkafka's mock cluster, in process) here;
a module ``benchmarks/transports_<name>.py`` with ``place()`` (a transport URL and
options), and ``raw_rate(count) -> float`` joins the table when present (amqp, nats,
broker).

    python -m benchmarks.transports [--messages N]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from reliable import App
from reliable.settings import Settings

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PLUGGED = ("amqp", "nats", "broker")


def workload(count: int, seed: int = 11) -> list[dict[str, Any]]:
    unique = [uuid.uuid4().hex for _ in range(int(count / 1.1))]
    rng = random.Random(seed)
    tokens = unique + rng.sample(unique, count - len(unique))
    rng.shuffle(tokens)
    return [{"token": token, "amount": 1} for token in tokens]


def framework_rate(url: str, options: dict[str, str], bodies: list[dict[str, Any]], *, batch: int | None) -> float:
    """Messages per second through ``@app.handler`` on transport ``url`` (publish not timed)."""
    run = uuid.uuid4().hex[:10]
    table, topic = f"bench_{run}", f"bench-{run}"
    env = {
        "RELIABLE_TRANSPORT__URL": url, "RELIABLE_STORE__URL": DATABASE_URL,
        "RELIABLE_CACHE__URL": REDIS_URL, "RELIABLE_LOG__LEVEL": "warning",
        "RELIABLE_WORKER__CONCURRENCY": "1" if batch else "4", "RELIABLE_WORKER__PREFETCH": "1000",
        **options,
    }
    app = App(Settings.load(None, env=env))
    with app.store.transaction() as tx:
        tx.execute(text(f"create table {table} (token varchar(64), amount integer)"))
    insert = text(f"insert into {table} (token, amount) values (:token, :amount)")

    if batch:
        @app.handler(topic, group=f"g-{run}", token="body.token", batch=batch)
        def handle_batch(messages, tx) -> None:
            tx.execute(insert, [m.body for m in messages])
    else:
        @app.handler(topic, group=f"g-{run}", token="body.token")
        def handle(message, tx) -> None:
            tx.execute(insert, message.body)

    for start in range(0, len(bodies), 1000):
        app.publish_many(topic, bodies[start:start + 1000])
    worker = threading.Thread(target=app.run, daemon=True)
    worker.start()
    done = lambda: sum(app.stats()[k] for k in ("processed", "duplicate"))  # noqa: E731
    while done() == 0:  # joining the group is not throughput: the clock starts at the first message
        time.sleep(0.001)
    began, first = time.perf_counter(), done()
    while done() < len(bodies):
        time.sleep(0.01)
    elapsed = time.perf_counter() - began
    app.stop()
    worker.join()
    with app.store.transaction() as tx:
        written = tx.execute(text(f"select count(*) from {table}")).scalar_one()
        tx.execute(text(f"drop table {table}"))
    app.close()
    assert written == len({b["token"] for b in bodies}), f"{written} rows for {len(bodies)} messages"
    return (len(bodies) - first) / elapsed


def redis_raw_rate(count: int) -> float:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    stream, group = f"bench-raw-{uuid.uuid4().hex[:8]}", "g"
    body = json.dumps({"token": "x" * 32, "amount": 1})
    pipe = client.pipeline(transaction=False)
    for _ in range(count):
        pipe.xadd(stream, {"body": body})
    pipe.execute()
    client.xgroup_create(stream, group, id="0")
    began, done = time.perf_counter(), 0
    while done < count:
        for _, entries in client.xreadgroup(group, "c", {stream: ">"}, count=500):
            client.xack(stream, group, *[entry_id for entry_id, _ in entries])
            done += len(entries)
    elapsed = time.perf_counter() - began
    client.delete(stream)
    return count / elapsed


def kafka_raw_rate(url: str, count: int) -> float:
    from confluent_kafka import Consumer, Producer

    servers = url.partition("://")[2]
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    producer = Producer({"bootstrap.servers": servers})
    body = json.dumps({"token": "x" * 32, "amount": 1}).encode()
    for _ in range(count):
        producer.produce(topic, body)
        producer.poll(0)
    producer.flush()
    consumer = Consumer({"bootstrap.servers": servers, "group.id": "raw", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False})
    consumer.subscribe([topic])
    done = 0
    while done == 0:  # joining the group is not throughput: the clock starts at the first message
        done = len(consumer.consume(500, timeout=1.0))
    began, first = time.perf_counter(), done
    while done < count:
        batch = consumer.consume(500, timeout=1.0)
        done += len(batch)
        if batch:
            consumer.commit(asynchronous=True)
    elapsed = time.perf_counter() - began
    consumer.close()
    return (count - first) / elapsed


def transports() -> list[tuple[str, str, dict[str, str], Callable[[int], float], Callable[[], None]]]:
    """(name, url, settings overrides, raw rate, cleanup) for every transport benchmarked."""
    from backends.transport.kafka_mock import MockCluster

    cluster = MockCluster(brokers=1)
    cluster.__enter__()
    found = [
        ("redis", f"{REDIS_URL}?namespace=bench-{uuid.uuid4().hex[:6]}", {}, redis_raw_rate, lambda: None),
        ("kafka (mock)", cluster.url, {}, lambda n: kafka_raw_rate(cluster.url, n),
         lambda: cluster.__exit__(None, None, None)),
    ]
    for name in PLUGGED:
        try:
            module = importlib.import_module(f"benchmarks.transports_{name}")
        except ModuleNotFoundError:
            continue
        url, options = module.place()
        found.append((name, url, options, module.raw_rate, getattr(module, "cleanup", lambda: None)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args()
    bodies = workload(args.messages)
    print(f"{args.messages} messages (10% duplicate tokens), PostgreSQL store + Redis cache\n")
    print(f"{'transport':<14} {'raw consume+ack':>16} {'framework/4':>12} {'batch/500':>10}   msg/s")
    for name, url, options, raw, cleanup in transports():
        try:
            rates = (raw(args.messages), framework_rate(url, options, bodies, batch=None),
                     framework_rate(url, options, bodies, batch=500))
        finally:
            cleanup()
        print(f"{name:<14} {rates[0]:>16,.0f} {rates[1]:>12,.0f} {rates[2]:>10,.0f}")


if __name__ == "__main__":
    main()
