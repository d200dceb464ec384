"""A framework worker in a process of its own, for the kill -9 chaos run (`tests/transports/chaos.py`).

``python -m tests.transports.chaos_worker TABLE TOPIC GROUP [batch|async]``
consumes ``TOPIC`` as ``GROUP`` (settings from ``RELIABLE_*`` variables: the
transactional commit strategy) until it is stopped or killed. The handler
inserts each token into ``TABLE``; a body with ``"poison": true`` fails for
good. ``batch`` (the default): a sync handler in batches of 50; ``async``: an
``async def`` handler with 20 messages in flight on its event loop.
"""

from __future__ import annotations

import asyncio
import sys
import time

from sqlalchemy import text

from reliable import App, Message


class PoisonError(Exception):
    """Raised for a message no retry can help."""


def main(table: str, topic: str, group: str, handler: str = "batch") -> None:
    app = App()
    insert = text(f"insert into {table} (token) values (:t)")

    if handler == "async":
        @app.handler(topic, group=group, token="body.token", concurrency=20, prefetch=100, fatal=[PoisonError])
        async def handle_async(message: Message, tx) -> None:
            if message.body.get("poison"):
                raise PoisonError(f"token {message.body['token']} is poison")
            await tx.execute(insert, {"t": message.body["token"]})
            await asyncio.sleep(0.001)  # widen the window in which a kill lands mid-transaction
    else:
        @app.handler(topic, group=group, token="body.token", batch=50, fatal=[PoisonError])
        def handle(messages: list[Message], tx) -> None:
            for message in messages:
                if message.body.get("poison"):
                    raise PoisonError(f"token {message.body['token']} is poison")
                tx.execute(insert, {"t": message.body["token"]})
                time.sleep(0.001)  # widen the window in which a kill lands mid-batch

    print("ready", flush=True)
    app.run()
    app.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
