"""What the framework suites read back from PostgreSQL: each token's side effect, each dead letter.

The handlers of `tests.transports.framework` and `tests.transports.chaos_worker`
insert each token into a table of the test's own (the ``effects`` fixture of
`tests/transports/conftest.py`); the framework writes dead letters into
``reliable_dead_letters``. A test polls both until they show what it expects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import create_engine, text

from reliable import Message

WAIT = 300.0
"""The bound on every wait for the database to show the expected effects."""


def effect_counts(postgres_url: str, table: str) -> dict[str, int]:
    """How many times each token's side effect is in ``table``."""
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        rows = conn.execute(text(f"select token, count(*) from {table} group by token")).all()
    engine.dispose()
    return {token: n for token, n in rows}


def dead_letter_counts(postgres_url: str, group: str, by: str = "token") -> dict[str, int]:
    """Dead-letter records of ``group`` per token (or per ``message_id``)."""
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(f'select {by}, count(*) from reliable_dead_letters where "group" = :g group by {by}'), {"g": group}
        ).all()
    engine.dispose()
    return {token: n for token, n in rows}


def wait_until(condition: Callable[[], bool], alive: Callable[[], bool] = lambda: True, every: float = 0.2) -> None:
    """Poll ``condition`` (a database query) every ``every`` seconds until it holds; bounded by `WAIT`."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert alive(), "the consumer stopped"
        assert time.monotonic() < deadline, "the expected effects never showed"
        time.sleep(every)


def insert_effect(tx: Any, table: str, message: Message) -> None:
    """The handler's own write: the message's token into ``table``, in the token's transaction."""
    tx.execute(text(f"insert into {table} (token) values (:t)"), {"t": message.body["token"]})
