"""One process of the outbox chain (`tests/transports/outbox_chain.py`): A's worker or B's worker.

``python -m tests.transports.outbox_chain_worker a NAME`` consumes ``NAME-a``
(group ``NAME-a``) in batches; for each message it publishes its follow-up to
``NAME-b`` through the outbox (``tx.publish``, the message's key kept), and
relays the outbox itself (settings from ``RELIABLE_*`` variables).
``... b NAME`` consumes ``NAME-b`` with the default token (the message id the
outbox row gave it) and records each token, message id and key in the table
``NAME_b``, whose serial column keeps the order B committed them in. On
SIGTERM it prints the app's counters as JSON.
"""

from __future__ import annotations

import json
import sys

from sqlalchemy import text

from reliable import App, Message


def main(role: str, name: str) -> None:
    app = App()

    if role == "a":
        @app.handler(f"{name}-a", group=f"{name}-a", token="body.token", batch=50)
        def forward(messages: list[Message], tx) -> None:
            for message in messages:
                tx.publish(f"{name}-b", {"token": message.body["token"]}, key=message.key)
    else:
        @app.handler(f"{name}-b", group=f"{name}-b", batch=50)
        def record(messages: list[Message], tx) -> None:
            tx.execute(text(f"insert into {name}_b (token, message_id, key) values (:t, :m, :k)"),
                       [{"t": m.body["token"], "m": m.id, "k": m.key} for m in messages])

    print("ready", flush=True)
    app.run()
    print(json.dumps(app.stats()), flush=True)
    app.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
