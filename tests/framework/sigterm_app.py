"""The app a real ``reliable run`` serves in the SIGTERM test (settings from RELIABLE_* variables).

Every message writes one row to the table named by SIGTERM_TABLE in its
transaction. The message with id ``hold`` first creates the file
SIGTERM_DIR/in-flight and waits (60 s at most) for SIGTERM_DIR/release:
the test sends SIGTERM while it is in the handler.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from sqlalchemy import text

from reliable import App, Message

TABLE = os.environ.get("SIGTERM_TABLE", "sigterm_effects")
FOLDER = Path(os.environ.get("SIGTERM_DIR", "."))

app = App()


@app.handler("work", group=TABLE, token="body.id", concurrency=1, prefetch=10)
def work(msg: Message, tx) -> None:
    tx.execute(text(f"insert into {TABLE} (token) values (:t)"), {"t": msg.body["id"]})
    if msg.body["id"] == "hold":
        (FOLDER / "in-flight").touch()
        released = FOLDER / "release"
        stop = threading.Event()
        for _ in range(6000):
            if released.exists() or stop.wait(0.01):
                break
