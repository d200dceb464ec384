"""This broker's server next to RabbitMQ, Redis Streams and NATS JetStream, in one run.

Produce (durable: the broker with ``flush = "sync"``, RabbitMQ with a durable
queue and persistent messages, JetStream with acknowledged publishes) and
consume+ack per second, 256-byte bodies, each client batching as it allows,
500 messages a batch wherever a client batches:

  reliable broker   `broker.client.Client`, one call at a time: publish 500 per request (acked after
                    the fsync); fetch 500, ack their receipts in one request
  ... pipelined     `broker.async_client.AsyncClient`: 4 publishes of 500 in flight (the server runs
                    those that queue up as one engine call: one fsync); 2 fetches of 500 in flight,
                    each batch's ack sent as it arrives
  RabbitMQ          pika BlockingConnection: an AMQP transaction per 500 publishes (commit-ok is the
                    broker's confirm); prefetch 500, one ack with multiple=True per 500
  ... confirms      pika BlockingConnection with publisher confirms, as the issue names them: pika's
                    blocking channel waits for each confirm (produce only, over at most 2,000
                    messages); the ratios use the faster RabbitMQ row
  Redis Streams     redis-py: XADD 500 per pipeline; XREADGROUP 500, one XACK of their ids
                    (the machine's Redis at REDIS_URL keeps nothing on disk: its produce is not
                    durable)
  ... AOF always    the same against a `redis-server` the benchmark starts on a free port with
                    ``appendonly yes``, ``appendfsync always``: Redis made durable (it fsyncs its
                    log before answering a pipeline); skipped if no `redis-server` is on PATH
  NATS JetStream    nats-py: 500 publishes in flight, awaited together; pull fetch 500, one ack of
                    the last (the consumer's ack policy is "all")

The ratios printed at the end take, for each rate, the faster of this broker's two clients.
The load average is printed before and after: on a busy machine compare runs of the same minute.
``--rounds R`` runs every row R times, one round of all rows after another, and prints each
row's best rate (as ``timeit`` keeps the best: the run least disturbed by the machine's other
work) and the ratios of every round.
For this broker's rows the CPU time of produce and of consume+ack is printed too, in µs per message, for the
server process (from /proc) and for the client: on a shared machine steadier than the rates.
``--only-broker`` runs this broker's rows alone; ``--consume-only R`` fills one server and
measures the sync client's consume+ack alone, R times (a fresh group each time).

    python -m benchmarks.broker_vs_peers [--messages N] [--rounds R] [--only-broker] [--consume-only R]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from broker.async_client import AsyncClient
from broker.client import Client
from broker.delivery.values import Delivery, OutgoingMessage

BODY = os.urandom(256)
BATCH = 500
FETCHES = 2  # fetches the pipelined client keeps in flight
ROOT = Path(__file__).resolve().parents[1]
AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")


def timed(count: int, run) -> float:  # type: ignore[no-untyped-def]
    began = time.perf_counter()
    run()
    return count / (time.perf_counter() - began)


class Server:
    """A broker server process: its address, and the CPU seconds it has used so far."""

    def __init__(self, address: str, pid: int) -> None:
        self.address = address
        self.pid = pid

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class CpuPerMessage:
    """The CPU time of a produce or a consume+ack (``what``), server and client, in µs per message."""

    def __init__(self, server: Server, what: str = "consume+ack") -> None:
        self.server, self.what = server, what
        self.began = (server.cpu(), time.process_time())

    def done(self, name: str, count: int) -> None:
        server, client = self.server.cpu() - self.began[0], time.process_time() - self.began[1]
        CPU_NOTES.append(f"{name}: {self.what} CPU per message: server {server / count * 1e6:.2f} µs, "
                         f"client {client / count * 1e6:.2f} µs")


CPU_NOTES: list[str] = []


@contextmanager
def broker_server() -> Iterator[Server]:
    """A broker server process (``flush = "sync"``) on a fresh directory."""
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        with open(log, "w") as out:
            server = subprocess.Popen([sys.executable, "-m", "broker", "serve", "--data-dir",
                                       f"{folder}/data", "--port", "0", "--stomp-port", "0"],
                                      cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            while not (found := re.findall(r"native_port=(\d+)", log.read_text())):
                time.sleep(0.05)
            yield Server(f"127.0.0.1:{found[0]}", server.pid)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait()


def reliable_broker(count: int) -> tuple[float, float]:
    """The sync client, one request at a time: publish 500, fetch 500 then ack them."""
    with broker_server() as server:
        client = Client(server.address)
        batch = [OutgoingMessage(BODY) for _ in range(BATCH)]
        cpu = CpuPerMessage(server, "produce")
        produce = timed(count, lambda: [client.publish("bench", batch) for _ in range(count // BATCH)])
        cpu.done("reliable broker", count)
        member = client.join("g", ["bench"], prefetch=1000)

        def consume() -> None:
            done = 0
            while done < count:
                deliveries = client.fetch(member, BATCH, 1.0)
                client.ack(member, [d.receipt for d in deliveries])
                done += len(deliveries)

        cpu = CpuPerMessage(server)
        consumed = timed(count, consume)
        cpu.done("reliable broker", count)
        client.close()
        return produce, consumed


def consume_only(count: int, rounds: int) -> None:
    """The sync client's consume+ack, ``rounds`` times over one filled server."""
    with broker_server() as server:
        client = Client(server.address)
        batch = [OutgoingMessage(BODY) for _ in range(BATCH)]
        for _ in range(count // BATCH):
            client.publish("bench", batch)
        for number in range(rounds):
            member = client.join(f"g{number}", ["bench"], prefetch=1000)
            cpu = CpuPerMessage(server)
            began, done = time.perf_counter(), 0
            while done < count:
                deliveries = client.fetch(member, BATCH, 1.0)
                client.ack(member, [d.receipt for d in deliveries])
                done += len(deliveries)
            print(f"consume+ack {count / (time.perf_counter() - began):>10,.0f} msg/s")
            cpu.done("  ", count)
            print(CPU_NOTES.pop())
            client.leave(member)
        client.close()


def reliable_broker_pipelined(count: int) -> tuple[float, float]:
    """The asyncio client: 4 publishes of 500 in flight; 2 fetches of 500 in flight, each batch's ack
    sent as it arrives."""
    async def run(server: Server) -> tuple[float, float]:
        async with AsyncClient(server.address) as client:
            batch = [OutgoingMessage(BODY) for _ in range(BATCH)]
            in_flight = asyncio.Semaphore(4)

            async def publish() -> None:
                async with in_flight:
                    await client.publish("bench", batch)

            cpu, began = CpuPerMessage(server, "produce"), time.perf_counter()
            await asyncio.gather(*(publish() for _ in range(count // BATCH)))
            produce = count / (time.perf_counter() - began)
            cpu.done("reliable broker pipelined", count)
            member = await client.join("g", ["bench"], prefetch=2000)
            cpu = CpuPerMessage(server)
            began, done, acks = time.perf_counter(), 0, []
            fetches: deque[asyncio.Task[list[Delivery]]] = deque()
            while done < count:
                while len(fetches) < FETCHES and done + len(fetches) * BATCH < count:
                    fetches.append(asyncio.create_task(client.fetch(member, BATCH, 1.0)))
                deliveries = await fetches.popleft()
                acks.append(asyncio.create_task(client.ack(member, [d.receipt for d in deliveries])))
                done += len(deliveries)
            await asyncio.gather(*acks, *fetches)
            consumed = count / (time.perf_counter() - began)
            cpu.done("reliable broker pipelined", count)
            return produce, consumed

    with broker_server() as server:
        return asyncio.run(run(server))


def rabbitmq(count: int) -> tuple[float, float]:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    channel = connection.channel()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(queue, durable=True)
    properties = pika.BasicProperties(delivery_mode=2)

    def produce() -> None:
        channel.tx_select()
        for _ in range(count // BATCH):
            for _ in range(BATCH):
                channel.basic_publish("", queue, BODY, properties)
            channel.tx_commit()

    produced = timed(count, produce)
    channel = connection.channel()  # acks on a transactional channel would wait for a commit too
    channel.basic_qos(prefetch_count=BATCH)
    done = 0

    def consume() -> None:
        nonlocal done
        for method, _, _ in channel.consume(queue):
            done += 1
            if done % BATCH == 0 or done == count:
                channel.basic_ack(method.delivery_tag, multiple=True)
            if done == count:
                break

    consumed = timed(count, consume)
    channel.cancel()
    channel.queue_delete(queue)
    connection.close()
    return produced, consumed


def rabbitmq_confirms(count: int) -> tuple[float, float]:
    """Produce only: a durable queue, publisher confirms (pika's blocking channel waits for each)."""
    import pika

    count = min(count, 2000)
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    channel = connection.channel()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    properties = pika.BasicProperties(delivery_mode=2)
    produced = timed(count, lambda: [channel.basic_publish("", queue, BODY, properties) for _ in range(count)])
    channel.queue_delete(queue)
    connection.close()
    return produced, float("nan")


def redis_streams(count: int, url: str = REDIS_URL) -> tuple[float, float]:
    import redis

    client = redis.Redis.from_url(url)
    stream = f"bench-{uuid.uuid4().hex[:8]}"

    def produce() -> None:
        for _ in range(count // BATCH):
            pipe = client.pipeline(transaction=False)
            for _ in range(BATCH):
                pipe.xadd(stream, {"body": BODY})
            pipe.execute()

    produced = timed(count, produce)
    client.xgroup_create(stream, "g", id="0")

    def consume() -> None:
        done = 0
        while done < count:
            for _, entries in client.xreadgroup("g", "c", {stream: ">"}, count=BATCH):
                client.xack(stream, "g", *[entry_id for entry_id, _ in entries])
                done += len(entries)

    consumed = timed(count, consume)
    client.delete(stream)
    return produced, consumed


def redis_streams_durable(count: int) -> tuple[float, float]:
    """`redis_streams` against a redis-server of our own that fsyncs its append-only file always."""
    import redis

    if shutil.which("redis-server") is None:
        return math.nan, math.nan
    with tempfile.TemporaryDirectory() as folder, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", folder,
                                   "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            return redis_streams(count, f"redis://127.0.0.1:{port}/0")
        finally:
            server.terminate()
            server.wait()


def jetstream(count: int) -> tuple[float, float]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    async def run() -> tuple[float, float]:
        connection = await nats.connect(NATS_URL)
        js = connection.jetstream()
        name = f"bench{uuid.uuid4().hex[:8]}"
        await js.add_stream(name=name, subjects=[f"{name}.x"])
        began = time.perf_counter()
        for _ in range(count // BATCH):
            await asyncio.gather(*(js.publish(f"{name}.x", BODY) for _ in range(BATCH)))
        produce = count / (time.perf_counter() - began)
        subscription = await js.pull_subscribe(f"{name}.x", durable="g",
                                               config=ConsumerConfig(ack_policy=AckPolicy.ALL))
        began, done = time.perf_counter(), 0
        while done < count:
            messages = await subscription.fetch(BATCH, timeout=5)
            await messages[-1].ack()  # acks every earlier message of the consumer too
            done += len(messages)
        consume = count / (time.perf_counter() - began)
        await js.delete_stream(name)
        await connection.close()
        return produce, consume

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--only-broker", action="store_true", help="this broker's rows alone")
    parser.add_argument("--consume-only", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every row this many times, interleaved; print each row's best")
    arguments = parser.parse_args()
    count = arguments.messages // BATCH * BATCH
    if arguments.consume_only:
        print(f"{count} messages of 256 bytes, load average {load()}")
        consume_only(count, arguments.consume_only)
        print(f"load average {load()}")
        return
    print(f"{count} messages of 256 bytes, {arguments.rounds} round(s), load average {load()}\n")
    rows = [(name, run) for name, run in ROWS if name.startswith("reliable") or not arguments.only_broker]
    rounds: list[dict[str, tuple[float, float]]] = []
    for _ in range(arguments.rounds):  # every row once per round: a disturbance hits one round, not one row
        rounds.append({name: run(count) for name, run in rows})
    best = {name: (max(r[name][0] for r in rounds), max(r[name][1] for r in rounds)) for name, _ in rows}
    print(f"{'':<26}{'produce':>10}{'consume+ack':>14}   msg/s" + ("   (best of each row's rounds)" if len(rounds) > 1 else ""))
    for name, (produced, consumed) in best.items():
        print(f"{name:<26}{produced:>10,.0f}{'—' if math.isnan(consumed) else f'{consumed:,.0f}':>14}")
    print("\n".join(CPU_NOTES))
    for peer in ("Redis Streams", "Redis Streams, AOF always", "RabbitMQ") if not arguments.only_broker else ():
        print(f"reliable broker (its faster client) / {peer}: produce {_ratio(best, peer, 0)}, "
              f"consume+ack {_ratio(best, peer, 1)}"
              + (f"; round by round: produce {', '.join(_ratio(r, peer, 0) for r in rounds)}, "
                 f"consume+ack {', '.join(_ratio(r, peer, 1) for r in rounds)}" if len(rounds) > 1 else ""))
    print("targets: >= 1.5x Redis Streams and >= 5x RabbitMQ on both rates")
    print(f"load average {load()}")


def _ratio(rates: dict[str, tuple[float, float]], peer: str, which: int) -> str:
    """The faster of this broker's clients over ``peer``, at produce (0) or consume+ack (1)."""
    ours = max(rate[which] for name, rate in rates.items() if name.startswith("reliable"))
    return f"{ours / rates[peer][which]:.2f}x"


ROWS = (("reliable broker", reliable_broker), ("reliable broker pipelined", reliable_broker_pipelined),
        ("RabbitMQ", rabbitmq), ("RabbitMQ, confirms", rabbitmq_confirms), ("Redis Streams", redis_streams),
        ("Redis Streams, AOF always", redis_streams_durable), ("NATS JetStream", jetstream))


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


if __name__ == "__main__":
    main()
