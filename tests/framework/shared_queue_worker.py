"""A member of a group whose members share Redis Streams queues, for the kill -9 test of the
group's saved position (`test_shared_queue_kill.py`; configured by environment).

Consumes topic ``work`` as group TABLE with four lanes and the transactional commit strategy:
each token's effect, its token and the queue positions commit together. On its first delivery
the message of token ``victim`` is held: the member writes its process id to ``TABLE_holder``
(committed at once, apart from the handler's transaction) and waits to be killed with it.
"""

from __future__ import annotations

import os
import threading

from sqlalchemy import create_engine, text

from reliable import App

VICTIM = "victim"


def main(table: str) -> None:
    app = App()  # settings from RELIABLE_* environment variables

    @app.handler("work", group=table, token="body.token", commit="transactional", concurrency=4)
    def handle(msg, tx) -> None:  # type: ignore[no-untyped-def]
        if msg.body["token"] == VICTIM and msg.attempt == 1:
            engine = create_engine(os.environ["RELIABLE_STORE__URL"])
            with engine.begin() as conn:
                conn.execute(text(f"insert into {table}_holder (pid) values (:pid)"), {"pid": os.getpid()})
            threading.Event().wait()  # until killed, the message and its fetch in hand
        tx.execute(text(f"insert into {table} (token) values (:t)"), {"t": msg.body["token"]})

    app.run(until_idle=True)
    app.close()
