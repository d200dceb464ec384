"""A framework worker that records each token's effect with its key and per-key number, for the
two-member kill -9 run of `tests/transports/test_kafka_rebalance.py`, which reads them back with
`keyed_effects`.

``main(table, topic, group)`` consumes ``topic`` as ``group`` (settings from ``RELIABLE_*``
variables) with 4 lanes, so messages of different keys finish out of order while one key's
keep theirs; each effect is a row ``(token, key, n, pid)`` of ``table``, whose serial id is the order
the effects were written in (``pid``: the worker's process, so a kill can wait for its victim's own work).
"""

from __future__ import annotations

import os
import time

from sqlalchemy import text

from reliable import App, Message
from tests.transports.effects import query


def main(table: str, topic: str, group: str) -> None:
    app = App()
    insert = text(f"insert into {table} (token, key, n, pid) values (:t, :k, :n, :p)")

    @app.handler(topic, group=group, token="body.token", concurrency=4, prefetch=40)
    def handle(message: Message, tx) -> None:
        tx.execute(insert, {"t": message.body["token"], "k": message.key, "n": message.body["n"], "p": os.getpid()})
        time.sleep(0.002)  # widen the window in which a kill lands mid-transaction

    app.run()
    app.close()


def keyed_effects(postgres_url: str, table: str) -> dict[str, list[int]]:
    """Each key's numbers in the order their effects were written."""
    effects: dict[str, list[int]] = {}
    for key, n in query(postgres_url, f"select key, n from {table} order by id"):
        effects.setdefault(key, []).append(n)
    return effects
