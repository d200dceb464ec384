"""This broker's server next to RabbitMQ, Redis Streams and NATS JetStream, in one run.

Produce (durable: the broker with ``flush = "sync"``, RabbitMQ with a durable
queue and publisher confirms, JetStream with acknowledged publishes) and
consume+ack per second, 256-byte bodies, each client batching as it allows:

  reliable broker   `broker.client.Client`: publish 100 per request; fetch 500, ack the receipts
  ... pipelined     `broker.async_client.AsyncClient`: 4 publishes of 500 in flight; acks sent
                    while the next batch is fetched
  RabbitMQ          pika BlockingConnection: confirm per publish; prefetch 500, ack multiple
  Redis Streams     redis-py: XADD 100 per pipeline; XREADGROUP 500, XACK (this Redis keeps nothing on disk)
  NATS JetStream    nats-py: 100 publishes awaited together; pull fetch 500, ack each

    python -m benchmarks.broker_vs_peers [--messages N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from broker.async_client import AsyncClient
from broker.client import Client
from broker.delivery.values import OutgoingMessage

BODY = os.urandom(256)
ROOT = Path(__file__).resolve().parents[1]
AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")


def timed(count: int, run) -> float:  # type: ignore[no-untyped-def]
    began = time.perf_counter()
    run()
    return count / (time.perf_counter() - began)


@contextmanager
def broker_server() -> Iterator[str]:
    """A broker server process (``flush = "sync"``) on a fresh directory; its address."""
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        with open(log, "w") as out:
            server = subprocess.Popen([sys.executable, "-m", "broker", "serve", "--data-dir",
                                       f"{folder}/data", "--port", "0", "--stomp-port", "0"],
                                      cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            while not (found := re.findall(r"native_port=(\d+)", log.read_text())):
                time.sleep(0.05)
            yield f"127.0.0.1:{found[0]}"
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait()


def reliable_broker(count: int) -> tuple[float, float]:
    """The sync client, one request at a time: publish 100, fetch 500 then ack them."""
    with broker_server() as address:
        client = Client(address)
        batch = [OutgoingMessage(BODY) for _ in range(100)]
        produce = timed(count, lambda: [client.publish("bench", batch) for _ in range(count // 100)])
        member = client.join("g", ["bench"], prefetch=1000)

        def consume() -> None:
            done = 0
            while done < count:
                deliveries = client.fetch(member, 500, 1.0)
                client.ack(member, [d.receipt for d in deliveries])
                done += len(deliveries)

        consumed = timed(count, consume)
        client.close()
        return produce, consumed


def reliable_broker_pipelined(count: int) -> tuple[float, float]:
    """The asyncio client: 4 publishes of 500 in flight; each batch's ack sent while the next is fetched."""
    async def run(address: str) -> tuple[float, float]:
        async with AsyncClient(address) as client:
            batch = [OutgoingMessage(BODY) for _ in range(500)]
            in_flight = asyncio.Semaphore(4)

            async def publish() -> None:
                async with in_flight:
                    await client.publish("bench", batch)

            began = time.perf_counter()
            await asyncio.gather(*(publish() for _ in range(count // 500)))
            produce = count / (time.perf_counter() - began)
            member = await client.join("g", ["bench"], prefetch=2000)
            began, done, acks = time.perf_counter(), 0, []
            while done < count:
                deliveries = await client.fetch(member, 500, 1.0)
                acks.append(asyncio.create_task(client.ack(member, [d.receipt for d in deliveries])))
                done += len(deliveries)
            await asyncio.gather(*acks)
            return produce, count / (time.perf_counter() - began)

    with broker_server() as address:
        return asyncio.run(run(address))


def rabbitmq(count: int) -> tuple[float, float]:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    channel = connection.channel()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    properties = pika.BasicProperties(delivery_mode=2)
    produce = timed(count, lambda: [channel.basic_publish("", queue, BODY, properties)
                                    for _ in range(count)])
    channel.basic_qos(prefetch_count=500)
    done = 0

    def consume() -> None:
        nonlocal done
        for method, _, _ in channel.consume(queue):
            done += 1
            if done % 500 == 0 or done == count:
                channel.basic_ack(method.delivery_tag, multiple=True)
            if done == count:
                break

    consumed = timed(count, consume)
    channel.cancel()
    channel.queue_delete(queue)
    connection.close()
    return produce, consumed


def redis_streams(count: int) -> tuple[float, float]:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    stream = f"bench-{uuid.uuid4().hex[:8]}"

    def produce() -> None:
        for _ in range(count // 100):
            pipe = client.pipeline(transaction=False)
            for _ in range(100):
                pipe.xadd(stream, {"body": BODY})
            pipe.execute()

    produced = timed(count, produce)
    client.xgroup_create(stream, "g", id="0")

    def consume() -> None:
        done = 0
        while done < count:
            for _, entries in client.xreadgroup("g", "c", {stream: ">"}, count=500):
                client.xack(stream, "g", *[entry_id for entry_id, _ in entries])
                done += len(entries)

    consumed = timed(count, consume)
    client.delete(stream)
    return produced, consumed


def jetstream(count: int) -> tuple[float, float]:
    import nats

    async def run() -> tuple[float, float]:
        connection = await nats.connect(NATS_URL)
        js = connection.jetstream()
        name = f"bench{uuid.uuid4().hex[:8]}"
        await js.add_stream(name=name, subjects=[f"{name}.x"])
        began = time.perf_counter()
        for _ in range(count // 100):
            await asyncio.gather(*(js.publish(f"{name}.x", BODY) for _ in range(100)))
        produce = count / (time.perf_counter() - began)
        subscription = await js.pull_subscribe(f"{name}.x", durable="g")
        began, done = time.perf_counter(), 0
        while done < count:
            messages = await subscription.fetch(500, timeout=5)
            await asyncio.gather(*(m.ack() for m in messages))
            done += len(messages)
        consume = count / (time.perf_counter() - began)
        await js.delete_stream(name)
        await connection.close()
        return produce, consume

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    count = parser.parse_args().messages // 500 * 500
    print(f"{count} messages of 256 bytes\n")
    print(f"{'':<26}{'produce':>10}{'consume+ack':>14}   msg/s")
    results = {}
    for name, run in (("reliable broker", reliable_broker),
                      ("reliable broker pipelined", reliable_broker_pipelined), ("RabbitMQ", rabbitmq),
                      ("Redis Streams", redis_streams), ("NATS JetStream", jetstream)):
        results[name] = run(count)
        print(f"{name:<26}{results[name][0]:>10,.0f}{results[name][1]:>14,.0f}")
    ours = results["reliable broker pipelined"]
    for peer in ("Redis Streams", "RabbitMQ"):
        theirs = results[peer]
        print(f"reliable broker pipelined / {peer}: produce {ours[0] / theirs[0]:.2f}x, "
              f"consume+ack {ours[1] / theirs[1]:.2f}x")
    print("targets: >= 1.5x Redis Streams and >= 5x RabbitMQ on both rates")


if __name__ == "__main__":
    main()
