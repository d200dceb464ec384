"""pika or aio-pika for `amqp://`: the same durable workload through each, in one run.

Both clients publish N persistent messages to a quorum queue with publisher
confirms (nothing counts as sent before the broker confirmed it), then
consume them with manual acks and a prefetch of 500.

* pika's `BlockingChannel` waits for each confirm before the next publish;
* pika in AMQP transactions: 500 publishes, one ``tx.commit`` (what
  ``amqp://`` did until a quorum queue's leader loss showed that commit-ok
  can come back for dropped messages; it then confirmed each publish, the
  first row, and now keeps a batch's confirms in flight, the third);
* ``amqp://``'s own path: ``AmqpTransport.publish`` in batches of 500 to a
  topic with one group (its quorum queue), each batch's confirms in flight
  together (`backends.transport.amqp_publisher`: pika's `SelectConnection`
  on a thread of its own); pika's blocking channel consumes the group's
  queue;
* aio-pika keeps a window of publishes in flight and awaits their confirms
  together.

Run: ``python -m benchmarks.amqp_clients [--count N]`` (RabbitMQ at ``AMQP_URL``,
default ``amqp://guest:guest@127.0.0.1:5672/``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Callable

import aio_pika
import pika
from pika.adapters.blocking_connection import BlockingChannel

from backends.transport.amqp_layout import Layout
from backends.transport.amqp_transport import AmqpTransport
from backends.types import OutgoingMessage

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
QUORUM = {"x-queue-type": "quorum"}
PREFETCH = 500
PERSISTENT = pika.BasicProperties(delivery_mode=2)
WINDOW = 500
"""Publishes aio-pika and amqp:// keep in flight before awaiting their confirms; pika's per transaction."""


def pika_run(count: int, body: bytes, publish: Callable[[BlockingChannel, str, int, bytes], None]) -> tuple[float, float]:
    """``publish`` ``count`` messages to a new quorum queue through pika, then consume them."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    queue = f"bench-pika-{uuid.uuid4().hex}"
    channel.queue_declare(queue, durable=True, arguments=QUORUM)
    started = time.perf_counter()
    publish(channel, queue, count, body)
    rate = count / (time.perf_counter() - started)
    channel = connection.channel()  # acks on a transactional channel would wait for a commit too
    consume = pika_consume(channel, queue, count)
    channel.queue_delete(queue)
    connection.close()
    return rate, consume


def confirm_each(channel: BlockingChannel, queue: str, count: int, body: bytes) -> None:
    channel.confirm_delivery()
    for _ in range(count):
        channel.basic_publish("", queue, body, PERSISTENT)


def transaction_per_window(channel: BlockingChannel, queue: str, count: int, body: bytes) -> None:
    channel.tx_select()
    for start in range(0, count, WINDOW):
        for _ in range(min(WINDOW, count - start)):
            channel.basic_publish("", queue, body, PERSISTENT)
        channel.tx_commit()


def framework_run(count: int, body: bytes) -> tuple[float, float]:
    """``AmqpTransport.publish`` in batches of `WINDOW` to a topic with one group, then pika consumes it."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    with AmqpTransport(URL, namespace=namespace) as transport:
        transport.declare("bench", ["bench"])
        started = time.perf_counter()
        for start in range(0, count, WINDOW):
            transport.publish("bench", [OutgoingMessage(body)] * min(WINDOW, count - start))
        rate = count / (time.perf_counter() - started)
        connection = pika.BlockingConnection(pika.URLParameters(URL))
        consume = pika_consume(connection.channel(), Layout(namespace).queue("bench", "bench"), count)
        connection.close()
        transport.purge()
    return rate, consume


def pika_consume(channel: BlockingChannel, queue: str, count: int) -> float:
    """Consume+ack rate of ``count`` messages of ``queue``, prefetch `PREFETCH`."""
    channel.basic_qos(prefetch_count=PREFETCH)
    received = 0
    started = time.perf_counter()
    for method, _properties, _body in channel.consume(queue, inactivity_timeout=5):
        if method is None:
            break
        channel.basic_ack(method.delivery_tag)
        received += 1
        if received == count:
            break
    rate = received / (time.perf_counter() - started)
    channel.cancel()
    return rate


async def aio_pika_run(count: int, body: bytes) -> tuple[float, float]:
    connection = await aio_pika.connect_robust(URL)
    channel = await connection.channel(publisher_confirms=True)
    queue_name = f"bench-aio-{uuid.uuid4().hex}"
    queue = await channel.declare_queue(queue_name, durable=True, arguments=QUORUM)
    started = time.perf_counter()
    for start in range(0, count, WINDOW):
        await asyncio.gather(*(
            channel.default_exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT), queue_name
            )
            for _ in range(min(WINDOW, count - start))
        ))
    publish = count / (time.perf_counter() - started)
    await channel.set_qos(prefetch_count=PREFETCH)
    received = 0
    started = time.perf_counter()
    async with queue.iterator() as messages:
        async for message in messages:
            await message.ack()
            received += 1
            if received == count:
                break
    consume = received / (time.perf_counter() - started)
    await queue.delete(if_unused=False, if_empty=False)
    await connection.close()
    return publish, consume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20_000)
    count = parser.parse_args().count
    body = b'{"token": "t-000000", "amount": 100}'
    rows = [("pika, confirm each", *pika_run(count, body, confirm_each)),
            ("pika, tx per 500", *pika_run(count, body, transaction_per_window)),
            ("amqp:// publish, 500 confirms", *framework_run(count, body)),
            ("aio-pika, 500 confirms", *asyncio.run(aio_pika_run(count, body)))]
    print(f"{count} persistent messages, quorum queue, prefetch {PREFETCH}, manual acks")
    print(f"{'client':<32}{'publish msg/s':>16}{'consume+ack msg/s':>20}")
    for name, publish, consume in rows:
        print(f"{name:<32}{publish:>16,.0f}{consume:>20,.0f}")


if __name__ == "__main__":
    main()
