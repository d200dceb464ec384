"""A framework worker that records each token's effect with its key and per-key number, for the
two-member kill -9 run of `tests/transports/test_kafka_rebalance.py`.

``main(table, topic, group)`` consumes ``topic`` as ``group`` (settings from ``RELIABLE_*``
variables) with 4 lanes, so messages of different keys finish out of order while one key's
keep theirs; each effect is a row ``(token, key, n)`` of ``table``, whose serial id is the order
the effects were written in.
"""

from __future__ import annotations

import time

from sqlalchemy import text

from reliable import App, Message


def main(table: str, topic: str, group: str) -> None:
    app = App()
    insert = text(f"insert into {table} (token, key, n) values (:t, :k, :n)")

    @app.handler(topic, group=group, token="body.token", concurrency=4, prefetch=40)
    def handle(message: Message, tx) -> None:
        tx.execute(insert, {"t": message.body["token"], "k": message.key, "n": message.body["n"]})
        time.sleep(0.002)  # widen the window in which a kill lands mid-transaction

    app.run()
    app.close()
