"""A claim sent ahead: all of a batch's tokens, in a pipeline that later bulk writes ride.

On PostgreSQL (psycopg) the claim of a whole batch is sent in pipeline mode
and not waited for: PostgreSQL inserts the token rows while the client goes
on, and bulk writes that follow in the same transaction (an ``executemany``
that returns nothing) join the same pipeline instead of waiting for the
claim. `ClaimAhead.settle` ends the pipeline and says whether the claim went
through: it is a plain ``INSERT`` of every token, so a token that already has
a row (done, leased, expired, or a concurrent twin's that commits) makes it
fail as a whole, and the transaction must then be rolled back.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, NoReturn

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from backends.store.claims import Claim
from backends.store.schema import tokens

_CLAIM = (
    f"INSERT INTO {tokens.name} (namespace, token, state, created_at, expires_at) "
    "SELECT %s, token, %s, %s, %s FROM unnest({tokens}) AS token"
)
_FROM_LINES = _CLAIM.replace("{tokens}", "string_to_array(%s, E'\\n')")
_FROM_ARRAY = _CLAIM.replace("{tokens}", "%s::text[]")


class ClaimAhead:
    """The claim of every token of ``claim``'s batch, sent into a pipeline left open."""

    def __init__(self, connection: Connection, claim: Claim) -> None:
        self._batch = batch = claim.batch
        self._claimed: set[str] | None = None
        driver = connection.connection.driver_connection
        assert driver is not None
        self._pipeline = ExitStack()
        self._pipeline.enter_context(driver.pipeline())
        try:
            self._cursor = driver.cursor()
            lines = "\n".join(batch)  # one text parameter: far cheaper to send than an array
            sent: str | list[str] = lines
            statement = _FROM_LINES
            if lines.count("\n") != len(batch) - 1:  # a token holds a line break
                statement, sent = _FROM_ARRAY, list(batch)
            self._cursor.execute(statement, (claim.namespace, claim.state, claim.now, claim.expires_at, sent))
        except BaseException as exc:
            self._pipeline.close()
            _reraise(exc)
        self.open = True

    def settle(self, *, quiet: bool = False) -> set[str] | None:
        """End the pipeline (once); the tokens claimed (all of them), or None if the claim did
        not go through.

        A failed statement that rode the pipeline after a claim that went
        through is raised (as SQLAlchemy raises it) unless ``quiet``.
        """
        if not self.open:
            return self._claimed
        self.open = False
        failure: Exception | None = None
        try:
            self._pipeline.close()  # syncs: every result is in
        except Exception as exc:  # psycopg's own errors: see below
            failure = exc
        from psycopg import pq  # the postgres extra; only reached on PostgreSQL

        result = self._cursor.pgresult
        went_through = result is not None and result.status == pq.ExecStatus.COMMAND_OK
        self._claimed = set(self._batch) if went_through else None
        if went_through and failure is not None and not quiet:
            _reraise(failure)
        return self._claimed


def _reraise(exc: BaseException) -> NoReturn:
    """Raise a psycopg error as SQLAlchemy would have raised it (so outages are recognised),
    anything else as it is."""
    import psycopg  # the postgres extra; only reached on PostgreSQL

    if isinstance(exc, psycopg.Error):
        raise DBAPIError.instance(_FROM_LINES, None, exc, psycopg.Error) from exc
    raise exc


def rides_pipeline(statement: Any, parameters: Any) -> bool:
    """Whether ``execute(statement, parameters)`` may join an open pipeline: a bulk write
    (several parameter sets) of an SQLAlchemy ``INSERT`` / ``UPDATE`` / ``DELETE`` that
    returns nothing. Anything that could return rows must wait for the pipeline to end."""
    bulk = isinstance(parameters, list | tuple) and len(parameters) > 1
    if not (bulk and getattr(statement, "is_dml", False)):
        return False
    # RETURNING columns (public since SQLAlchemy 1.4). A ``return_defaults()`` statement has
    # none and rides: reading its rows makes psycopg sync the pipeline first, which raises the
    # claim's failure, if any, there (see `reliable.spark.ahead`).
    return not statement.exported_columns
