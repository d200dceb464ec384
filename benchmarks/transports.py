"""Handler throughput per transport next to the transport's own consume+ack rate, in one run.

The same workload on every transport: ``--messages`` JSON messages (unique
tokens plus 10% duplicates), each handled by one INSERT into PostgreSQL,
idempotency on (PostgreSQL store + Redis cache):

  raw          the transport's own client: read and ack every message, nothing else
  framework/4  ``@app.handler`` per message, 4 handler threads (key-ordered dispatch)
  batch/500    ``@app.handler(batch=500)``: one transaction and one cache round trip per batch

Transports: ``embedded://`` (the broker engine), Redis Streams, Kafka
(librdkafka's mock cluster), RabbitMQ and NATS JetStream (its raw loop is
`benchmarks.transports_nats.raw`).

    python -m benchmarks.transports [--messages N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from benchmarks import transports_nats
from reliable import App
from reliable.settings import Settings

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")


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
    purge = getattr(app.transport, "purge", None)
    if purge is not None:  # a server's queues or streams of this run
        purge()
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


def amqp_raw_rate(count: int) -> float:
    """pika alone on a quorum queue: prefetch 500, manual ack of each message (publish not timed)."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    channel = connection.channel()
    queue = f"bench-raw-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    channel.tx_select()
    body = json.dumps({"token": "x" * 32, "amount": 1}).encode()
    for start in range(0, count, 1000):
        for _ in range(min(1000, count - start)):
            channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
        channel.tx_commit()
    consumer = connection.channel()
    consumer.basic_qos(prefetch_count=500)
    began, done = time.perf_counter(), 0
    for method, _properties, _body in consumer.consume(queue, inactivity_timeout=10):
        if method is None:
            break
        consumer.basic_ack(method.delivery_tag)
        done += 1
        if done == count:
            break
    elapsed = time.perf_counter() - began
    consumer.cancel()
    consumer.queue_delete(queue)
    connection.close()
    return done / elapsed


def embedded_raw_rate(count: int) -> float:
    """The broker engine's own consume+ack (what ``embedded://`` runs on)."""
    import tempfile

    from broker.delivery.engine import Broker
    from broker.delivery.values import OutgoingMessage as BrokerMessage

    with tempfile.TemporaryDirectory() as folder, Broker(folder) as broker:
        body = json.dumps({"token": "x" * 32, "amount": 1}).encode()
        for start in range(0, count, 1000):
            broker.publish("bench", [BrokerMessage(body) for _ in range(min(1000, count - start))])
        member = broker.join("g", ["bench"])
        began, done = time.perf_counter(), 0
        while done < count:
            deliveries = broker.fetch(member, 500, 1.0)
            broker.ack(member, [d.receipt for d in deliveries])
            done += len(deliveries)
        return count / (time.perf_counter() - began)


def measured(count: int, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of (transport, run, msg/s) for every transport benchmarked here."""
    import tempfile

    from backends.transport.kafka_mock import MockCluster

    found: list[dict[str, Any]] = []

    def add(name: str, url: str, raw: Callable[[int], float], what: str) -> None:
        found.append({"transport": name, "run": what, "msgs_per_s": raw(count)})
        for batch, label in ((None, "framework, 4 threads"), (500, "framework, batch 500")):
            found.append({"transport": name, "run": f"{label}, PostgreSQL + Redis",
                          "msgs_per_s": framework_rate(url, {}, bodies, batch=batch)})

    with tempfile.TemporaryDirectory() as folder:
        add("embedded", f"embedded://{folder}/broker", embedded_raw_rate, "raw: engine fetch(500) + ack")
    add("redis", f"{REDIS_URL}?namespace=bench-{uuid.uuid4().hex[:6]}", redis_raw_rate,
        "raw: XREADGROUP 500 + XACK")
    with MockCluster(brokers=1) as cluster:
        add("kafka (mock)", cluster.url, lambda n: kafka_raw_rate(cluster.url, n),
            "raw: consume(500) + async commit")
    add("rabbitmq", f"{AMQP_URL}?namespace=bench-{uuid.uuid4().hex[:6]}", amqp_raw_rate,
        "raw: pika, quorum queue, prefetch 500 + ack")
    add("nats", f"{NATS_URL}?namespace=bench{uuid.uuid4().hex[:6]}", transports_nats.raw,
        "raw: nats-py pull fetch(500) + ack")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args()
    bodies = workload(args.messages)
    print(f"{args.messages} messages (10% duplicate tokens), PostgreSQL store + Redis cache\n")
    print(f"{'transport':<14} {'run':<52} {'msg/s':>10}")
    for row in measured(args.messages, bodies):
        print(f"{row['transport']:<14} {row['run']:<52} {row['msgs_per_s']:>10,.0f}")


if __name__ == "__main__":
    main()
