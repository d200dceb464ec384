"""A worker process for `test_two_processes.py` (configured by RELIABLE_* environment variables).

    python -m tests.framework.overlap_worker TABLE COUNT ORDER   # ORDER: forward or backward

Joins a start line in PostgreSQL (``TABLE_ready``) and waits, with a bounded
poll, until both workers are there; then publishes tokens t0..tCOUNT-1 to its
own in-memory transport, in ORDER, and consumes them. Every handler call
records its process and its start and end on PostgreSQL's clock in
``TABLE_calls``, in the handler's transaction; the side effect goes to TABLE.
Prints the app's counters as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

from sqlalchemy import create_engine, text

from reliable import App, Message

WORKERS = 2
START_LINE_SECONDS = 60


def wait_at_the_start_line(url: str, table: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"insert into {table}_ready (pid) values (:p)"), {"p": os.getpid()})
    deadline = time.monotonic() + START_LINE_SECONDS
    with engine.connect() as conn:
        while (conn.execute(text(f"select count(*) from {table}_ready")).scalar() or 0) < WORKERS:
            if time.monotonic() > deadline:
                raise SystemExit("the other worker never reached the start line")
            time.sleep(0.01)
    engine.dispose()


def main(table: str, count: int, order: str) -> None:
    app = App()
    pid = os.getpid()

    @app.handler("work", group=table, token="body.token")
    def handle(msg: Message, tx) -> None:
        started = tx.execute(text("select clock_timestamp()")).scalar()
        tx.execute(text(f"insert into {table} (token, pid) values (:t, :p)"), {"t": msg.body["token"], "p": pid})
        tx.execute(text(f"insert into {table}_calls (pid, token, started, ended) "
                        "values (:p, :t, :s, clock_timestamp())"), {"p": pid, "t": msg.body["token"], "s": started})

    tokens = [f"t{i}" for i in range(count)]
    wait_at_the_start_line(os.environ["RELIABLE_STORE__URL"], table)
    app.publish_many("work", [{"token": t} for t in (tokens if order == "forward" else tokens[::-1])])
    app.run(until_idle=True)
    print(json.dumps(app.stats()), flush=True)
    app.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
