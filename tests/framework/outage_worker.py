"""A worker for `test_outage_restart`, configured by ``RELIABLE_*`` environment variables:
``python -m tests.framework.outage_worker TABLE``. Its handler fails transiently the first
time it runs in this process, then writes the token and the delivery's attempt to TABLE."""

from __future__ import annotations

import sys

from sqlalchemy import text

from reliable import App

table = sys.argv[1]
app = App()
failed: list[str] = []


@app.handler(table, group=table, token="body.token")
def handle(msg, tx) -> None:
    if not failed:
        failed.append(msg.body["token"])
        raise ConnectionError("the first real attempt fails transiently")
    tx.execute(text(f"insert into {table} (token, attempt) values (:t, :a)"), {"t": msg.body["token"], "a": msg.attempt})


app.run()
app.close()
