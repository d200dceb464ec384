"""An I/O-bound handler, async next to sync and next to a hand-written asyncio loop, in one run.

The work per message (the same in every row): claim the token in the token
table, await 20 ms (a call to another service), insert one row, commit; the
claim and the insert in one transaction, on PostgreSQL. Every row consumes the
same in-memory transport (fetch, ack), so the difference is the handler's.

  (a) the framework, `async def` handler, 100 messages in flight on one event loop
  (b) the framework, the same work as a sync handler (time.sleep), 4 threads
  (c) a hand-written asyncio loop: fetch, then 100 tasks at a time, each one
      transaction on SQLAlchemy's async engine (psycopg async) claiming and inserting
  (d) the same loop without the 20 ms await: the rate at which this machine
      commits such transactions at all, the ceiling of every row above

Targets (issue 27): (a) >= 0.8x (c) and >= 10x (b). Where (d) is below 10x (b),
the second target is above what the database itself does here.

    python -m benchmarks.async_handlers [--messages N] [--in-flight N]

Each row with N in flight holds N PostgreSQL connections (the transaction is
open across the await): a shared server needs max_connections to spare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable

from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from backends.store import open_store
from backends.transport import MemoryTransport
from backends.types import OutgoingMessage
from reliable import App, Message
from reliable.settings import Settings

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
IN_FLIGHT = 100
THREADS = 4
WAIT = 0.020
TOKEN_COLUMNS = "namespace, token, state, created_at, expires_at"
TTL = 7 * 86400.0


def payloads(count: int) -> list[bytes]:
    return [json.dumps({"token": uuid.uuid4().hex}).encode() for _ in range(count)]


def app_with(table: str, data: list[bytes], *, concurrency: int, prefetch: int) -> App:
    env = {"RELIABLE_STORE__URL": DATABASE_URL, "RELIABLE_CACHE__URL": "none", "RELIABLE_TRANSPORT__URL": "memory://",
           "RELIABLE_LOG__LEVEL": "warning", "RELIABLE_WORKER__PREFETCH": str(prefetch),
           "RELIABLE_WORKER__CONCURRENCY": str(concurrency)}
    app = App(Settings.load(None, env=env))
    app.publish_many("bench", data)
    return app


def framework_async(table: str, data: list[bytes]) -> Callable[[], None]:
    app = app_with(table, data, concurrency=IN_FLIGHT, prefetch=IN_FLIGHT)
    insert = text(f"insert into {table} values (:token)")

    @app.handler("bench", group=table, token="body.token")
    async def handle(msg: Message, tx) -> None:
        await asyncio.sleep(WAIT)
        await tx.execute(insert, msg.body)

    return lambda: (app.run(until_idle=True), app.close())  # type: ignore[func-returns-value]


def framework_sync(table: str, data: list[bytes]) -> Callable[[], None]:
    app = app_with(table, data, concurrency=THREADS, prefetch=IN_FLIGHT)
    insert = text(f"insert into {table} values (:token)")

    @app.handler("bench", group=table, token="body.token")
    def handle(msg: Message, tx) -> None:
        time.sleep(WAIT)
        tx.execute(insert, msg.body)

    return lambda: (app.run(until_idle=True), app.close())  # type: ignore[func-returns-value]


def hand_loop(table: str, data: list[bytes], wait: float = WAIT) -> Callable[[], None]:
    source = MemoryTransport()
    source.publish("bench", [OutgoingMessage(p) for p in data])
    claim = text(f"insert into reliable_tokens ({TOKEN_COLUMNS}) values (:ns, :token, 'done', :now, :exp) "
                 "on conflict do nothing returning token")
    insert = text(f"insert into {table} values (:token)")

    async def consume() -> None:
        engine = create_async_engine(DATABASE_URL, pool_size=IN_FLIGHT)
        member = source.subscribe(table, ["bench"])

        async def one(payload: bytes) -> None:
            body = json.loads(payload)
            now = time.time()
            async with engine.begin() as conn:
                if (await conn.execute(claim, {"ns": table, "token": body["token"], "now": now,
                                               "exp": now + TTL})).first():
                    await asyncio.sleep(wait)
                    await conn.execute(insert, body)

        while messages := member.fetch(IN_FLIGHT, 0):
            await asyncio.gather(*(one(m.payload) for m in messages))
            member.ack(messages)
        await engine.dispose()

    return lambda: asyncio.run(consume())


def main() -> None:
    global IN_FLIGHT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="messages in flight for (a) and (c)")
    args = parser.parse_args()
    IN_FLIGHT = args.in_flight
    open_store(DATABASE_URL).close()  # the token table exists before any row starts
    engine = create_engine(DATABASE_URL)
    rows = [(f"(a) framework, async def, {IN_FLIGHT} in flight", framework_async, args.messages),
            ("(b) framework, sync, 4 threads", framework_sync, max(args.messages // 10, 200)),
            (f"(c) hand-written asyncio loop, {IN_FLIGHT} in flight", hand_loop, args.messages),
            ("(d) the loop without the await: the ceiling", lambda t, d: hand_loop(t, d, 0.0), args.messages)]
    rates: dict[str, float] = {}
    for name, build, count in rows:
        table = f"bench_async_{uuid.uuid4().hex[:8]}"
        with engine.begin() as conn:
            conn.execute(text(f"create table {table} (token varchar(64))"))
        try:
            run = build(table, payloads(count))
            started = time.perf_counter()
            run()
            rates[name] = count / (time.perf_counter() - started)
            with engine.connect() as conn:
                done = conn.execute(text(f"select count(*), count(distinct token) from {table}")).one()
            assert done[0] == done[1] == count, f"{name}: {done} rows, expected {count} once each"
        finally:
            with engine.begin() as conn:
                conn.execute(text(f"drop table {table}"))
                conn.execute(text("delete from reliable_tokens where namespace = :ns"), {"ns": table})
    a, b, c, d = rates.values()
    print(f"{'handler (20 ms await + 1 insert, PostgreSQL)':<48} {'msg/s':>8}")
    for name, rate in rates.items():
        print(f"{name:<48} {rate:>8.0f}")
    print(f"async / hand-written loop: {a / c:.2f}x (target >= 0.8x); async / sync 4 threads: {a / b:.1f}x (target >= 10x)")
    print(f"the database's ceiling / sync 4 threads: {d / b:.1f}x (no handler can pass this)")
    engine.dispose()


if __name__ == "__main__":
    main()
