"""The whole pipeline on one machine: ``python -m examples.pipeline [--orders N]``.

Starts a broker server (``python -m broker serve``, data under
``.reliable/pipeline/``), sends the orders (5% twice, 1% poison), runs the
Spark job once over everything, prints what PostgreSQL holds and stops the
server. ``DATABASE_URL`` names the database (default: the local PostgreSQL).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

from examples.pipeline.job import run
from examples.pipeline.produce import orders, produce

HOME = Path(".reliable/pipeline")
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    log = HOME / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "broker", "serve", "--data-dir", str(HOME / "broker"),
                                   "--port", "0", "--stomp-port", "0"], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not (found := re.findall(r"native_port=(\d+)", log.read_text())):
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the broker server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    return server, f"reliable://127.0.0.1:{found[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=20_000)
    count = parser.parse_args().orders
    shutil.rmtree(HOME, ignore_errors=True)
    HOME.mkdir(parents=True)
    run_id = uuid.uuid4().hex[:8]  # a fresh topic, fence and tables per run of the demo
    topic, table = f"orders-{run_id}", f"pipeline_{run_id}"
    server, url = start_server()
    try:
        print(f"broker server at {url}; sent {produce(url, topic, count)} messages for {count} orders")
        run(url, topic, str(HOME / "checkpoint"), DATABASE_URL, max_rows=max(1000, count // 4), table=table)
    finally:
        server.terminate()
        server.wait()
    expected = orders(count)
    valid = {o["token"] for o in expected if o["amount"] != "oops"}
    database = create_engine(DATABASE_URL)
    with database.begin() as connection:
        written = connection.execute(text(f"select count(*), count(distinct token) from {table}")).one()
        poisoned = connection.execute(text(f"select count(*) from {table}_dlq")).scalar()
        connection.execute(text(f"drop table {table}"))
        connection.execute(text(f"drop table {table}_dlq"))
    print(f"\n{table}: {written[0]} rows, {written[1]} distinct orders; dead letters: {poisoned}")
    print(f"each valid order exactly once: {'YES' if written[0] == written[1] == len(valid) else 'NO'}")
    print(f"each poison order dead-lettered once: {'YES' if poisoned == count - len(valid) else 'NO'}")


if __name__ == "__main__":
    main()
