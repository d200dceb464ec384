"""The transactional outbox next to publishing directly, in one run.

1. Handler throughput, batch mode (``batch=500``): each message makes one
   INSERT into a table of the store's database and publishes one message,
   (a) through the outbox (``tx.publish``; the relay's sending is inside the
   timing: ``run(until_idle=True)`` returns once the outbox is drained), next
   to (b) the same handler calling ``app.publish`` directly (not exactly once).
   Target: (a) >= 0.7x (b).
2. Relay throughput: N committed rows sent by `Relay.drain`, next to the same
   N messages (with the content-type header every published message carries)
   published by ``transport.publish`` in batches of the relay's size, right
   after; ``--rounds`` such pairs, the median of their ratios. Target: >= 0.8x.
3. Commit-to-consumer latency of an idle relay: one row per transaction, the
   next one written once the consumer got the last; the relay runs on its
   thread, woken by the commit (same process) and, on PostgreSQL, by a
   commit from another store (``NOTIFY``, as from another process).

    python -m benchmarks.outbox [--messages N] [--store sqlite|postgresql] [--transport URL] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import create_engine, text

from backends.store import SqlStore, Store
from backends.types import CONTENT_TYPE, JSON, OutgoingMessage
from reliable import App, Message
from reliable.settings import Settings

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BATCH = 500
T = TypeVar("T")


SERVER_TOPOLOGY = ("amqp", "amqps", "redis", "rediss", "nats", "tls")
"""Schemes whose server keeps what a run declares (queues, streams) after it ends."""


def own_namespace(transport: str, name: str) -> tuple[str, bool]:
    """``transport`` under a namespace of the run's own where its server keeps queues or streams,
    and whether it is the run's to delete afterwards (not when the URL names a namespace)."""
    if transport.split("://")[0] not in SERVER_TOPOLOGY or "namespace=" in transport:
        return transport, False
    return f"{transport}{'&' if '?' in transport else '?'}namespace={name}", True


def make_app(folder: Path, store: str, transport: str, name: str) -> App:
    env = {"RELIABLE_STORE__URL": store, "RELIABLE_TRANSPORT__URL": transport, "RELIABLE_CACHE__URL": "memory://",
           "RELIABLE_OUTBOX__NAME": name, "RELIABLE_LOG__LEVEL": "warning"}
    return App(Settings.load(None, env=env))


def handler_rate(app: App, name: str, count: int, through_outbox: bool) -> float:
    """Messages per second of the batch handler that writes a row and publishes one message."""
    with app.store.transaction() as tx:
        tx.execute(text(f"create table {name}_rows (token varchar(64))"))
    app.transport.declare(f"{name}-out", [f"{name}-out"])  # amqp:// keeps messages only for known groups

    @app.handler(f"{name}-in", group=f"{name}-in", token="body.token", batch=BATCH)
    def forward(messages: list[Message], tx) -> None:
        tx.execute(text(f"insert into {name}_rows (token) values (:t)"), [{"t": m.body["token"]} for m in messages])
        for m in messages:
            if through_outbox:
                tx.publish(f"{name}-out", {"token": m.body["token"]})
            else:
                app.publish(f"{name}-out", {"token": m.body["token"]})

    for start in range(0, count, BATCH):
        app.publish_many(f"{name}-in", [{"token": f"t{n}"} for n in range(start, min(start + BATCH, count))])
    started = time.perf_counter()
    app.run(until_idle=True)
    return count / (time.perf_counter() - started)


def relay_rates(app: App, name: str, count: int, rounds: int) -> tuple[float, float, list[float]]:
    """Rows per second of `Relay.drain` and messages per second of the transport's own publish
    (medians), and the ratio of each round: a drain and a publish right after it, so a shared
    machine's load weighs on both sides of a ratio alike."""
    size, headers = app.settings.outbox.batch_size, {CONTENT_TYPE: JSON}  # the relay's batches, its messages
    relayed, published, ratios = [], [], []
    for topic in (f"{name}-relayed", f"{name}-direct"):
        app.transport.declare(topic, [topic])  # amqp:// keeps messages only for known groups
    for _ in range(rounds):
        for start in range(0, count, BATCH):
            with app.store.transaction() as tx:
                for n in range(start, min(start + BATCH, count)):
                    tx.publish(f"{name}-relayed", {"n": n}, key=f"k{n % 64}")
        started = time.perf_counter()
        app.relay().drain()
        relayed.append(count / (time.perf_counter() - started))
        messages = [OutgoingMessage(f'{{"n":{n}}}'.encode(), key=f"k{n % 64}", headers=headers,
                                    message_id=uuid.uuid4().hex) for n in range(count)]
        started = time.perf_counter()
        for start in range(0, count, size):
            app.transport.publish(f"{name}-direct", messages[start : start + size])
        published.append(count / (time.perf_counter() - started))
        ratios.append(relayed[-1] / published[-1])
    return statistics.median(relayed), statistics.median(published), sorted(ratios)


def latencies(app: App, writer: Store, name: str, samples: int) -> list[float]:
    """Seconds from each commit's return to the consumer's fetch, one row at a time."""
    topic, arrived = f"{name}-latency-{uuid.uuid4().hex[:6]}", threading.Event()
    app.transport.declare(topic, [topic])
    got: dict[str, float] = {}
    stop = threading.Event()

    def consume() -> None:
        with app.transport.subscribe(topic, [topic]) as subscription:
            while not stop.is_set():
                batch = subscription.fetch(10, timeout=0.2)
                now = time.perf_counter()
                for m in batch:
                    got[m.id] = now
                if batch:
                    subscription.ack(batch)
                    arrived.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    committed: dict[str, float] = {}
    with app.relay().running():
        for n in range(samples):
            arrived.clear()
            with writer.transaction() as tx:
                message_id = tx.publish(topic, {"n": n})
            committed[message_id] = time.perf_counter()
            if not arrived.wait(10):
                raise RuntimeError(f"row {n} never reached the consumer")
    stop.set()
    consumer.join()
    return [got[i] - t for i, t in committed.items()]


def vacuum_outbox(app: App) -> None:
    """Clear the dead rows of the outbox tables: a test server may run without autovacuum (this
    machine's does), and every test's relay leaves its moved rows dead in ``reliable_outbox``
    (900,000 once, which doubled the relay's move by statement, 26 -> 11 us/row best of 15)."""
    app.store.outbox.status()  # the tables exist
    engine = create_engine(DATABASE_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text("vacuum reliable_outbox, reliable_outbox_sent_rows"))
    engine.dispose()


def row(label: str, values: list[str]) -> str:
    return f"{label:<58}" + "".join(f"{v:>16}" for v in values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--store", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--transport", default=None, help="transport URL (default: embedded in a temporary folder)")
    parser.add_argument("--samples", type=int, default=300, help="commits measured for the latency")
    parser.add_argument("--rounds", type=int, default=5, help="relay rounds, each a drain then a direct publish")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)

        def fresh(label: str, run: Callable[[App, str], T]) -> T:
            name = f"b{uuid.uuid4().hex[:10]}"
            store = DATABASE_URL if args.store == "postgresql" else f"sqlite:///{root / label / 'store.db'}"
            transport, ours = own_namespace(args.transport or f"embedded://{root / label / 'broker'}", name)
            app = make_app(root / label, store, transport, name)
            if args.store == "postgresql":
                vacuum_outbox(app)
            try:
                return run(app, name)
            finally:
                with app.store.transaction() as tx:
                    tx.execute(text(f"drop table if exists {name}_rows"))
                    for table in ("reliable_outbox", "reliable_outbox_sent_rows"):
                        tx.execute(text(f"delete from {table} where outbox = :n"), {"n": name})
                    # the handlers' tokens (namespaces "<name>-in", ...): 10,000 rows a run were left
                    tx.execute(text("delete from reliable_tokens where namespace like :p"), {"p": f"{name}-%"})
                if ours:  # a run left a RabbitMQ its queues (file handles: 235 of them stopped it)
                    app.transport.purge()  # type: ignore[attr-defined]
                app.close()

        outbox = fresh("outbox", lambda app, name: handler_rate(app, name, args.messages, True))
        direct = fresh("direct", lambda app, name: handler_rate(app, name, args.messages, False))
        relay, publish, ratios = fresh("relay", lambda app, name: relay_rates(app, name, args.messages, args.rounds))

        def latency(app: App, name: str) -> dict[str, list[float]]:
            found = {"same process (in-process wake-up)": latencies(app, app.store, name, args.samples)}
            if args.store == "postgresql":
                other = SqlStore(DATABASE_URL, outbox=name)
                found["another store (PostgreSQL NOTIFY)"] = latencies(app, other, name, args.samples)
                other.close()
            return found

        waits = fresh("latency", latency)
    print(f"outbox benchmark: {args.messages} messages, store {args.store}, transport "
          f"{args.transport or 'embedded://'}, batch {BATCH}")
    print(row("", ["msg/s", "ratio", "target"]))
    print(row("handler, batch mode: INSERT + tx.publish (relay included)", [f"{outbox:,.0f}", f"{outbox / direct:.2f}x", ">= 0.70x"]))
    print(row("handler, batch mode: INSERT + app.publish (not exactly once)", [f"{direct:,.0f}", "1.00x", ""]))
    print(row(f"relay: Relay.drain of committed rows (median of {args.rounds})",
              [f"{relay:,.0f}", f"{statistics.median(ratios):.2f}x", ">= 0.80x"]))
    print(row("transport.publish, batches of the relay's size", [f"{publish:,.0f}", "1.00x", ""]))
    print(row("  ratio of each round (drain, then publish)", [" ".join(f"{r:.2f}" for r in ratios)]))
    print(row("commit-to-consumer latency", ["p50 ms", "p99 ms", "max ms"]))
    for label, values in waits.items():
        ms = sorted(v * 1000 for v in values)
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        print(row(f"  {label}", [f"{statistics.median(ms):.2f}", f"{p99:.2f}", f"{ms[-1]:.2f}"]))


if __name__ == "__main__":
    main()
