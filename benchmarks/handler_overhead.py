"""Messages per second of the handler framework next to hand-written loops, in one run.

Workload (the same for every row): unique tokens plus 10% duplicates,
shuffled, one INSERT per message into a table of the store's database.

Every loop consumes the same in-memory transport (fetch 500, ack), so the
transport's own cost is the same on both sides and the difference is the
framework's.

  (a) hand-written per-message loop: claim the token + insert, one transaction each
  (b) the framework per message (`@app.handler`, memory transport)
  (c) the framework in batch mode (`batch=500`)
  (d) hand-written batched loop: bulk claim + bulk insert, one transaction per 500
  (e) PostgreSQL only: the fastest hand-written batched loop, raw psycopg 3, one
      transaction per 500, the claim and the insert each ONE statement over arrays
      (``unnest``), no SQLAlchemy, no cache

On PostgreSQL the batch handler of (c) is written the same way as (e): one
``INSERT ... SELECT * FROM unnest(...)`` for the whole batch (SQLite, which has no
arrays, gets one ``executemany``). On SQLite (memory cache) and on PostgreSQL +
Redis. The hand-written loops use the same durability settings as the store
(SQLite: WAL, synchronous=FULL).

    python -m benchmarks.handler_overhead [--per-message N] [--batch N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psycopg
from sqlalchemy import Engine, create_engine, event, text

from backends.store import open_store
from backends.transport import MemoryTransport
from backends.types import OutgoingMessage
from reliable import App, Message
from reliable.settings import Settings

BATCH = 500
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def workload(count: int, seed: int = 7) -> list[bytes]:
    """``count`` messages: unique tokens plus 10% duplicates of them, shuffled."""
    unique = [f"{uuid.uuid4().hex}" for _ in range(int(count / 1.1))]
    rng = random.Random(seed)
    messages = unique + rng.sample(unique, count - len(unique))
    rng.shuffle(messages)
    return [json.dumps({"token": t, "amount": 1}).encode() for t in messages]


def engine_for(url: str) -> Engine:
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            dbapi_connection.execute("pragma journal_mode=wal")
            dbapi_connection.execute("pragma synchronous=full")
    return engine


def setup_tables(engine: Engine, table: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"create table {table} (token varchar(64), amount integer)"))


# The hand-written loops claim into the same token table as the framework (created by
# opening the store), with the namespace column set to the run's table name, so both
# pay for the same unique index on a table of the same size.
TOKEN_COLUMNS = "namespace, token, state, created_at, expires_at"
TTL = 7 * 86400.0


def loaded_transport(topic: str, payloads: list[bytes]) -> MemoryTransport:
    """The same in-memory transport the framework consumes from, holding ``payloads``."""
    transport = MemoryTransport()
    transport.publish(topic, [OutgoingMessage(p) for p in payloads])
    return transport


def hand_per_message(engine: Engine, table: str, source: MemoryTransport) -> None:
    """Fetch, then per message: one transaction claiming the token and inserting; ack."""
    claim = text(f"insert into reliable_tokens ({TOKEN_COLUMNS}) values (:ns, :token, 'done', :now, :exp) "
                 "on conflict do nothing returning token")
    insert = text(f"insert into {table} values (:token, :amount)")
    member = source.subscribe(table, ["bench"])
    while messages := member.fetch(BATCH, 0):
        for message in messages:
            body = json.loads(message.payload)
            now = time.time()
            with engine.begin() as conn:
                if conn.execute(claim, {"ns": table, "token": body["token"], "now": now, "exp": now + TTL}).first():
                    conn.execute(insert, body)
            member.ack([message])


def hand_batched(engine: Engine, table: str, source: MemoryTransport) -> None:
    """Fetch 500, one transaction: bulk claim, bulk insert of the claimed; ack the 500."""
    insert = text(f"insert into {table} values (:token, :amount)")
    member = source.subscribe(table, ["bench"])
    while messages := member.fetch(BATCH, 0):
        bodies = {}
        for message in messages:
            body = json.loads(message.payload)
            bodies.setdefault(body["token"], body)
        now = time.time()
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                statement = text(
                    f"insert into reliable_tokens ({TOKEN_COLUMNS}) select :ns, unnest(cast(:tokens as text[])), "
                    "'done', :now, :exp on conflict do nothing returning token")
                parameters = {"ns": table, "tokens": list(bodies), "now": now, "exp": now + TTL}
            else:
                values = ", ".join(f"(:ns, :t{i}, 'done', :now, :exp)" for i in range(len(bodies)))
                statement = text(f"insert into reliable_tokens ({TOKEN_COLUMNS}) values {values} "
                                 "on conflict do nothing returning token")
                parameters = {"ns": table, "now": now, "exp": now + TTL, **{f"t{i}": t for i, t in enumerate(bodies)}}
            claimed = set(conn.execute(statement, parameters).scalars())
            if claimed:
                conn.execute(insert, [bodies[t] for t in claimed])
        member.ack(messages)


def raw_batched(url: str, table: str, source: MemoryTransport) -> None:
    """Raw psycopg 3, fetch 500, one transaction: the claim of every token as one statement over
    an array, then the business rows of the claimed tokens as one statement over arrays; ack."""
    claim = (f"insert into reliable_tokens ({TOKEN_COLUMNS}) select %s, token, 'done', %s, %s "
             "from unnest(%s::text[]) as token on conflict do nothing returning token")
    insert = f"insert into {table} (token, amount) select * from unnest(%s::text[], %s::integer[])"
    member = source.subscribe(table, ["bench"])
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        while messages := member.fetch(BATCH, 0):
            bodies = {}
            for message in messages:
                body = json.loads(message.payload)
                bodies.setdefault(body["token"], body)
            now = time.time()
            cursor.execute(claim, (table, now, now + TTL, list(bodies)))
            claimed = [row[0] for row in cursor.fetchall()]
            if claimed:
                cursor.execute(insert, (claimed, [bodies[t]["amount"] for t in claimed]))
            conn.commit()
            member.ack(messages)


def libpq_url(url: str) -> str:
    """``url`` as libpq reads it (no SQLAlchemy driver suffix)."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def framework(store: str, cache: str, table: str, payloads: list[bytes], batch: int | None) -> App:
    env = {"RELIABLE_STORE__URL": store, "RELIABLE_CACHE__URL": cache, "RELIABLE_TRANSPORT__URL": "memory://",
           "RELIABLE_LOG__LEVEL": "warning", "RELIABLE_WORKER__PREFETCH": str(BATCH)}
    app = App(Settings.load(None, env=env))
    insert = text(f"insert into {table} values (:token, :amount)")

    arrays = text(f"insert into {table} (token, amount) "
                  "select * from unnest(cast(:tokens as text[]), cast(:amounts as integer[]))")

    if batch and store.startswith("postgresql"):
        @app.handler("bench", group=table, token="body.token", batch=batch)
        def handle_arrays(msgs: list[Message], tx) -> None:  # as (e) writes it: one statement
            bodies = [m.body for m in msgs]
            tx.execute(arrays, {"tokens": [b["token"] for b in bodies], "amounts": [b["amount"] for b in bodies]})
    elif batch:
        @app.handler("bench", group=table, token="body.token", batch=batch)
        def handle_batch(msgs: list[Message], tx) -> None:
            tx.execute(insert, [m.body for m in msgs])
    else:
        @app.handler("bench", group=table, token="body.token")
        def handle(msg: Message, tx) -> None:
            tx.execute(insert, msg.body)

    app.publish_many("bench", payloads)
    return app


def timed(run: Callable[[], object], count: int) -> float:
    started = time.perf_counter()
    run()
    return count / (time.perf_counter() - started)


def check(engine: Engine, table: str, payloads: list[bytes]) -> None:
    expected = len({json.loads(p)["token"] for p in payloads})
    with engine.connect() as conn:
        rows = conn.execute(text(f"select count(*), count(distinct token) from {table}")).one()
    assert rows[0] == rows[1] == expected, f"{table}: {rows} rows, expected {expected} once each"


def measure(label: str, store_url: str, cache_url: str, per_message: int, batched: int,
            repeats: int) -> dict[str, float]:
    """Median rate of each variant over ``repeats`` rounds, the variants interleaved in each round."""
    store = open_store(store_url)
    store.known("bench", ["create-tables"])  # the store creates its tables on first use
    store.close()
    engine = engine_for(store_url)
    postgres = engine.dialect.name == "postgresql"
    runs: dict[str, list[float]] = {"a": [], "b": [], "c": [], "d": [], **({"e": []} if postgres else {})}

    created: list[str] = []

    def table() -> str:
        name = f"bench_{uuid.uuid4().hex[:8]}"
        setup_tables(engine, name)
        created.append(name)
        return name

    for _ in range(repeats):
        small, large = workload(per_message), workload(batched)
        t = table()
        runs["a"].append(timed(partial(hand_per_message, engine, t, loaded_transport("bench", small)), len(small)))
        check(engine, t, small)
        for key, payloads, batch in (("b", small, None), ("c", large, BATCH)):
            t = table()
            app = framework(store_url, cache_url, t, payloads, batch)
            runs[key].append(timed(partial(app.run, until_idle=True), len(payloads)))
            check(engine, t, payloads)
            app.close()
        t = table()
        runs["d"].append(timed(partial(hand_batched, engine, t, loaded_transport("bench", large)), len(large)))
        check(engine, t, large)
        if postgres:
            t = table()
            raw = partial(raw_batched, libpq_url(store_url), t, loaded_transport("bench", large))
            runs["e"].append(timed(raw, len(large)))
            check(engine, t, large)
    with engine.begin() as conn:  # leave the shared database as it was
        for name in created:
            conn.execute(text(f"drop table {name}"))
            conn.execute(text("delete from reliable_tokens where namespace = :ns"), {"ns": name})
    engine.dispose()
    rates = {key: statistics.median(values) for key, values in runs.items()}
    print(f"  {label}: " + ", ".join(f"({k}) {v:,.0f}" for k, v in rates.items()), flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-message", type=int, default=3000, help="messages for (a) and (b)")
    parser.add_argument("--batch", type=int, default=50000, help="messages for (c) and (d)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the table shows medians")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="reliable-bench-"))
    print(f"workload: unique tokens + 10% duplicates; (a)/(b) {args.per_message} messages, "
          f"(c)/(d) {args.batch} messages, batch {BATCH}; median of {args.repeats} interleaved rounds; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results = {
        "SQLite + memory cache": measure("SQLite", f"sqlite:///{folder / 'bench.db'}", "memory://",
                                         args.per_message, args.batch, args.repeats),
        "PostgreSQL + Redis": measure("PostgreSQL+Redis", DATABASE_URL, REDIS_URL, args.per_message, args.batch,
                                      args.repeats),
    }
    print()
    print("| backend | (a) hand loop | (b) framework | (c) framework batch | (d) hand batched "
          "| (e) raw psycopg batched | (a)/(b) ≤ 1.3x | (c)/(d) ≥ 0.75 | (c)/(e) ≥ 0.5 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        raw = f"{r['e']:,.0f}" if "e" in r else "—"
        versus_raw = f"{r['c'] / r['e']:.2f}" if "e" in r else "—"
        print(f"| {label} | {r['a']:,.0f} | {r['b']:,.0f} | {r['c']:,.0f} | {r['d']:,.0f} | {raw} "
              f"| {r['a'] / r['b']:.2f}x | {r['c'] / r['d']:.2f} | {versus_raw} |")
    print("\nmessages per second; targets in the headers: per message within 1.3x of the hand loop, "
          "batch >= 0.75x the hand-batched loop and, on PostgreSQL + Redis, >= 0.5x raw psycopg")


if __name__ == "__main__":
    main()
