"""A worker process for the transactional kill -9 test (configured by environment).

    python -m tests.framework.offsets_worker TABLE

Consumes topic ``work`` with four lanes and the transactional commit strategy:
each token's effect, its token and the queue positions commit together.
"""

from __future__ import annotations

import sys

from sqlalchemy import text

from reliable import App


def main(table: str) -> None:
    app = App()  # settings from RELIABLE_* environment variables

    @app.handler("work", group=table, token="body.token", commit="transactional", concurrency=4)
    def handle(msg, tx) -> None:
        tx.execute(text(f"insert into {table} (token) values (:t)"), {"t": msg.body["token"]})

    app.run(until_idle=True)
    app.close()


if __name__ == "__main__":
    main(sys.argv[1])
