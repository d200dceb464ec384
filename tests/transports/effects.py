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

from sqlalchemy import Engine, create_engine, text

from reliable import Message

WAIT = 300.0
"""The bound on every wait for the database to show the expected effects."""


_ENGINES: dict[str, Engine] = {}


def _engine(postgres_url: str) -> Engine:
    """One engine per database URL for the whole process: a poll every 50 ms reuses its connections
    (a new engine per query made PostgreSQL start a backend process for each)."""
    if postgres_url not in _ENGINES:
        _ENGINES[postgres_url] = create_engine(postgres_url, pool_size=2)
    return _ENGINES[postgres_url]


def query(postgres_url: str, sql: str, **parameters: object) -> list[tuple]:
    """The rows of ``sql`` (none for a statement), in a transaction of its own."""
    with _engine(postgres_url).begin() as conn:
        result = conn.execute(text(sql), parameters)
        return [tuple(row) for row in result] if result.returns_rows else []


def effect_counts(postgres_url: str, table: str) -> dict[str, int]:
    """How many times each token's side effect is in ``table``."""
    return dict(query(postgres_url, f"select token, count(*) from {table} group by token"))


def effect_count(postgres_url: str, table: str) -> int:
    """How many side effects ``table`` holds (a token written twice counts twice)."""
    return int(query(postgres_url, f"select count(*) from {table}")[0][0])


def dead_letter_counts(postgres_url: str, group: str, by: str = "token") -> dict[str, int]:
    """Dead-letter records of ``group`` per token (or per ``message_id``)."""
    return dict(query(postgres_url, f'select {by}, count(*) from reliable_dead_letters where "group" = :g group by {by}',
                      g=group))


def dead_letter_count(postgres_url: str, group: str) -> int:
    """How many distinct tokens of ``group`` are dead-lettered."""
    return int(query(postgres_url, 'select count(distinct token) from reliable_dead_letters where "group" = :g',
                     g=group)[0][0])


def effects_and_dead_letters(postgres_url: str, table: str, group: str) -> int:
    """`effect_count` plus `dead_letter_count` in one query: the kill -9 run's progress, which it
    polls 20 times a second (two queries cost 1.5 ms of CPU a poll, client and server)."""
    return int(query(postgres_url, f'select (select count(*) from {table}) + (select count(distinct token)'
                     ' from reliable_dead_letters where "group" = :g)', g=group)[0][0])


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
