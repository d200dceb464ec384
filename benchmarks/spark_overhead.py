"""Rows per second of a plain ``foreachBatch`` against the same function under ``@foreach_batch``.

    .venv/bin/python -m benchmarks.spark_overhead [--batches 10] [--rows 100000] [--preload 1000000]
                                                  [--cache redis://127.0.0.1:6379/0]

Three sides, two rounds each, in the order plain, wrapped, wrapped with
``sink="store"``, and back (ABCCBA), so that a drift of the machine during
the run weighs on every side alike. All rounds stream the same Parquet files
(one file per micro-batch, every token new) into a PostgreSQL table through
``insert_rows`` (the exactly-once sink: rows written in the batch
transaction). The plain one opens its own transaction; the wrapped ones get
the fence, the token check against a store holding ``--preload`` tokens
(bulk-loaded with COPY just before each wrapped round, after the tokens of
any earlier round were deleted), the claim and the commit; with
``sink="store"`` the claim is sent ahead of the function. A small warm-up query
runs first so no side pays for starting Spark's Python workers; the token
table is vacuumed after the preload (as autovacuum would keep it) and a
``CHECKPOINT`` precedes each round. Needs PostgreSQL at $DATABASE_URL
(default postgresql+psycopg://postgres@127.0.0.1:5432/test).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import text

import reliable
from backends.store.schema import tokens as token_table
from reliable.spark import foreach_batch, insert_rows
from reliable.spark.session import local_session

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SCHEMA = "order_id string, customer string, amount_cents long, note string"
TTL = 30 * 86_400.0


def write_files(folder: Path, prefix: str, batches: int, rows: int) -> None:
    """``batches`` Parquet files of ``rows`` orders each, tokens ``<prefix>-<file>-<row>``."""
    folder.mkdir(parents=True)
    for number in range(batches):
        ids = [f"{prefix}-{number}-{i}" for i in range(rows)]
        table = pa.table(
            {
                "order_id": ids,
                "customer": [f"customer-{i % 977}" for i in range(rows)],
                "amount_cents": pa.array([(i * 37) % 100_000 for i in range(rows)], pa.int64()),
                "note": ["benchmark order with a short note"] * rows,
            }
        )
        path = folder / f"{number:04d}.parquet"
        pq.write_table(table, path)
        stamp = time.time() - 3600 + number  # the file source reads in modification-time order
        os.utime(path, (stamp, stamp))


def preload_tokens(app: Any, namespace: str, count: int) -> float:
    """COPY ``count`` DONE tokens of ``namespace`` into the store; return the seconds it took."""
    started = time.perf_counter()
    now = app.clock.time()
    raw = app.store.engine.raw_connection()
    try:
        with raw.cursor() as cursor:
            columns = "namespace, token, state, created_at, expires_at"
            with cursor.copy(f"COPY {token_table.name} ({columns}) FROM STDIN") as copy:
                for i in range(count):
                    copy.write_row((namespace, f"old-{i}", "done", now, now + TTL))
        raw.commit()
    finally:
        raw.close()
    return time.perf_counter() - started


def forget_tokens(app: Any, namespaces: list[str]) -> None:
    """Delete every token of ``namespaces``, and vacuum: millions of dead rows are not left."""
    with app.store.transaction() as tx:
        tx.execute(token_table.delete().where(token_table.c.namespace.in_(namespaces)))
    maintain(app, f"VACUUM {token_table.name}")


def maintain(app: Any, *statements: str) -> None:
    """Run ``VACUUM`` / ``CHECKPOINT`` statements (outside a transaction, as they must be)."""
    with app.store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        for statement in statements:
            connection.execute(text(statement))


def stream(
    spark: Any, source: Path, checkpoint: Path, batch_function: Callable[[Any, int], Any]
) -> float:
    """Seconds to stream every file of ``source`` through ``batch_function``."""
    started = time.perf_counter()
    query = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(source))
        .writeStream.foreachBatch(batch_function)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return time.perf_counter() - started


def plain_writer(app: Any, table: str, seconds: list[float]) -> Callable[[Any, int], None]:
    def write(df: Any, batch_id: int) -> None:
        started = time.perf_counter()
        with app.store.transaction() as tx:
            insert_rows(df, tx, table)
        seconds.append(time.perf_counter() - started)

    return write


def wrapped_writer(
    app: Any, table: str, name: str, reports: list[Any], writers: list[Any], sink: str = "any"
) -> Callable[[Any, int], Any]:
    @foreach_batch(app, name=name, token="order_id", ttl=TTL, sink=sink)
    def write(df: Any, batch_id: int, tx: Any) -> None:
        insert_rows(df, tx, table)

    writers.append(write)
    return lambda df, batch_id: reports.append(write(df, batch_id))


# ABCCBA: a drift of the machine weighs on every side alike
ROUNDS = ("plain", "wrapped", "store", "store", "wrapped", "plain")
LABELS = {"plain": "plain", "wrapped": "@foreach_batch", "store": '@foreach_batch(sink="store")'}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10, help="micro-batches per round")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per batch")
    parser.add_argument(
        "--preload", type=int, default=1_000_000, help="tokens already in the store"
    )
    parser.add_argument(
        "--cache", default="none", help="the app's cache URL, e.g. redis://127.0.0.1:6379/0"
    )
    args = parser.parse_args()

    run = uuid.uuid4().hex[:8]
    work = Path(tempfile.mkdtemp(prefix="spark-overhead-"))
    env = {
        "RELIABLE_STORE__URL": DATABASE_URL,
        "RELIABLE_CACHE__URL": args.cache,
        "RELIABLE_TRANSPORT__URL": "memory://",
        "RELIABLE_LOG__LEVEL": "warning",
    }
    app = reliable.App(reliable.Settings.load(None, env=env))
    tables = {number: f"bench_{kind}_{number}_{run}" for number, kind in enumerate(ROUNDS)}
    tables["warm"] = f"bench_warm_{run}"
    namespaces = {number: f"bench-{run}-{number}" for number, kind in enumerate(ROUNDS)
                  if kind != "plain"}  # fmt: skip
    with app.store.transaction() as tx:
        for table in tables.values():
            tx.execute(
                text(
                    f"CREATE TABLE {table} (order_id TEXT, customer TEXT, amount_cents BIGINT, note TEXT)"
                )
            )
    loaded = 0.0
    write_files(work / "data", "new", args.batches, args.rows)
    write_files(work / "warm", "warm", 2, 1_000)

    seconds = dict.fromkeys(LABELS, 0.0)
    written = dict.fromkeys(LABELS, 0)
    plain_batches: list[float] = []
    rounds: list[float] = []  # seconds of each round, in ROUNDS order
    reports: dict[str, list[Any]] = {kind: [] for kind in LABELS}
    writers: list[Any] = []
    spark = local_session("reliable-spark-overhead", **{"spark.driver.memory": "2g"})
    try:
        warm_plain = plain_writer(app, tables["warm"], [])
        stream(spark, work / "warm", work / "ck-warm-plain", warm_plain)
        warm_wrapped = wrapped_writer(app, tables["warm"], f"bench-{run}-warm", [], writers, "store")
        stream(spark, work / "warm", work / "ck-warm-wrapped", warm_wrapped)
        for number, kind in enumerate(ROUNDS):
            if kind == "plain":
                writes = plain_writer(app, tables[number], plain_batches)
            else:  # a store holding --preload tokens, and nothing of an earlier round
                forget_tokens(app, list(namespaces.values()))
                loaded += preload_tokens(app, namespaces[number], args.preload)
                # the state autovacuum keeps a live table in (this server runs with it off)
                maintain(app, f"VACUUM ANALYZE {token_table.name}")
                writes = wrapped_writer(app, tables[number], namespaces[number], reports[kind],
                                        writers, sink="store" if kind == "store" else "any")  # fmt: skip
            maintain(app, "CHECKPOINT")  # no round pays for the previous one's dirty pages
            rounds.append(stream(spark, work / "data", work / f"ck-{number}", writes))
            seconds[kind] += rounds[-1]
            with app.store.transaction() as tx:
                count = text(f"SELECT count(*) FROM {tables[number]}")
                written[kind] += tx.execute(count).scalar_one()
    finally:
        spark.stop()
        with app.store.transaction() as tx:
            for table in tables.values():
                tx.execute(text(f"DROP TABLE IF EXISTS {table}"))
        forget_tokens(app, [*namespaces.values(), f"bench-{run}-warm"])
        if app.cache is not None:  # the tokens the wrapped rounds left in the cache
            for writer in writers:
                writer.flush()
            ids = [f"new-{number}-{i}" for number in range(args.batches) for i in range(args.rows)]
            for namespace in namespaces.values():
                app.cache.forget(namespace, ids)
            warm = [f"warm-{number}-{i}" for number in range(2) for i in range(1_000)]
            app.cache.forget(f"bench-{run}-warm", warm)
        shutil.rmtree(work, ignore_errors=True)

    rows = args.batches * args.rows * ROUNDS.count("plain")
    print(
        f"\n{ROUNDS.count('plain')} rounds each, in the order {', '.join(ROUNDS)}, of "
        f"{args.batches} batches x {args.rows:,} rows into PostgreSQL; each wrapped round's "
        f"store holding {args.preload:,} tokens (COPY, {loaded:.1f} s in all) and no others\n"
    )
    print(f"| {'foreachBatch':<30} | {'seconds':>8} | {'rows/s':>9} | {'rows written':>12} | overhead |")
    print(f"|{'-' * 32}|{'-' * 10}:|{'-' * 11}:|{'-' * 14}:|---------:|")
    for kind, label in LABELS.items():
        overhead = "" if kind == "plain" else f"{(seconds[kind] / seconds['plain'] - 1) * 100:.0f}%"
        print(
            f"| {label:<30} | {seconds[kind]:>8.1f} | {rows / seconds[kind]:>9,.0f} "
            f"| {written[kind]:>12,} | {overhead:>8} |"
        )
    print(
        f"\ntarget: overhead at most 25%; load average during the run: {os.getloadavg()[1]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    print("rounds: " + ", ".join(f"{kind} {took:.1f} s" for kind, took in zip(ROUNDS, rounds)))
    print(f"per batch: plain function {sum(plain_batches) / len(plain_batches):.2f} s")
    for kind in ("wrapped", "store"):
        done = reports[kind]
        phases = {phase: sum(r.seconds.get(phase, 0.0) for r in done) / len(done)
                  for phase in ("prepare", "claim", "function")}  # fmt: skip
        ahead = sum(r.ahead for r in done)
        print(
            f"  {LABELS[kind]}: "
            + ", ".join(f"{phase} {value:.2f} s" for phase, value in phases.items())
            + f"; cached: {sum(r.cached for r in done)} of {len(done)} batches"
            + (f"; claim sent ahead (within the function): {ahead} of {len(done)}" if ahead else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
