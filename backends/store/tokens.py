"""Token records: the claim under the unique index, lookups, leases and expiry.

Every function takes an open SQLAlchemy ``Connection`` (inside a transaction)
and the current time, so the store decides transaction boundaries and the
clock, and these stay plain statements (SQLAlchemy Core, one round trip each).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Double,
    String,
    any_,
    bindparam,
    delete,
    func,
    literal,
    null,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from backends.store.base import LeaseOutcome, TokenState
from backends.store.engine import chunk_size, chunks, upsert
from backends.store.schema import tokens

DONE = TokenState.DONE.value
IN_PROGRESS = TokenState.IN_PROGRESS.value


def claim(
    connection: Connection,
    namespace: str,
    batch: Sequence[str],
    now: float,
    ttl: float,
    state: str = DONE,
) -> set[str]:
    """Insert ``batch`` (no duplicates); return the tokens inserted or reclaimed from expired rows.

    One ``INSERT ... ON CONFLICT DO UPDATE ... WHERE expired RETURNING token``:
    a live row (committed, or being inserted by a concurrent twin, which makes
    this statement wait) is left alone and not returned.
    """
    if not batch:
        return set()
    expires_at = now + ttl
    if len(batch) == 1:  # the per-message path: a plain one-row INSERT
        parameters = {"namespace": namespace, "token": batch[0], "state": state, "now": now,
                      "expires_at": expires_at}
        one = _POSTGRES_CLAIM_ONE if connection.dialect.name == "postgresql" else _SQLITE_CLAIM_ONE
        return set(connection.execute(one, parameters).scalars())
    if connection.dialect.name == "postgresql":
        parameters = {"namespace": namespace, "state": state, "now": now, "expires_at": expires_at}
        lines = "\n".join(batch)  # one text parameter: far cheaper to send than an array
        if lines.count("\n") == len(batch) - 1:
            count, claimed = connection.execute(_POSTGRES_CLAIM_LINES, {**parameters, "lines": lines}).one()
            return set(batch) if count == len(batch) else set(claimed.split("\n")) if count else set()
        return set(connection.execute(_POSTGRES_CLAIM, {**parameters, "tokens": list(batch)}).scalars())
    parameters = {
        "namespace": namespace,
        "tokens": json.dumps(list(batch)),
        "state": state,
        "now": now,
        "expires_at": expires_at,
    }
    return set(connection.execute(_SQLITE_CLAIM, parameters).scalars())


COPY_CLAIM_MIN = 5_000
"""Batches at least this large are first claimed with ``COPY`` on PostgreSQL (see `claim_by_copy`)."""

_COPY = f"COPY {tokens.name} (namespace, token, state, created_at, expires_at) FROM STDIN"


def claim_by_copy(
    connection: Connection, namespace: str, batch: Sequence[str], now: float, ttl: float
) -> bool:
    """Claim all of ``batch`` with one ``COPY`` (PostgreSQL); False if any token has a row.

    ``COPY`` inserts about twice as fast as ``INSERT ... ON CONFLICT`` but
    cannot skip a conflict: a token with any row (done, leased, expired, or
    being inserted by a concurrent twin that then commits) fails it with a
    unique violation. It runs in a savepoint, so a failure rolls back to where
    it started and the caller claims the batch the usual way.
    """
    import psycopg  # the postgres extra; only reached on PostgreSQL

    nested = connection.begin_nested()
    try:
        driver = connection.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cursor, cursor.copy(_COPY) as copy:
            data = copy_rows(namespace, batch, now, now + ttl)
            if data is not None:
                copy.write(data)
            else:  # a NUL in a token: let the driver refuse it, as the INSERT would
                for token in batch:
                    copy.write_row((namespace, token, DONE, now, now + ttl))
    except psycopg.errors.UniqueViolation:
        nested.rollback()
        return False
    except psycopg.Error as exc:  # as SQLAlchemy would raise it: outages are recognised
        nested.rollback()
        raise DBAPIError.instance(_COPY, None, exc, psycopg.Error) from exc
    except BaseException:
        nested.rollback()
        raise
    nested.commit()
    return True


_COPY_ESCAPES = (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))


def copy_rows(namespace: str, batch: Sequence[str], now: float, expires_at: float) -> str | None:
    """The ``COPY`` text of ``batch``'s DONE rows, built in a few passes over one string.

    Per row, ``write_row`` costs more than PostgreSQL's own insert of it; here
    the tokens are joined with NUL (which no PostgreSQL text can hold), escaped
    for the text format all at once, and the NULs replaced by the rest of a row
    and the start of the next. None when a token holds a NUL.
    """
    body = "\0".join(batch)
    if body.count("\0") != len(batch) - 1:
        return None
    for plain, escaped in _COPY_ESCAPES:
        body = body.replace(plain, escaped)
        namespace = namespace.replace(plain, escaped)
    start, end = f"{namespace}\t", f"\t{DONE}\t{now!r}\t{expires_at!r}\n"
    return start + body.replace("\0", end + start) + end


def known(connection: Connection, namespace: str, batch: Sequence[str], now: float) -> set[str]:
    """The tokens of ``batch`` recorded DONE and not expired."""
    if connection.dialect.name == "postgresql":
        parameters = {"namespace": namespace, "tokens": list(batch), "done": DONE, "now": now}
        return set(connection.execute(_POSTGRES_KNOWN, parameters).scalars())
    parameters = {"namespace": namespace, "tokens": json.dumps(list(batch)), "done": DONE, "now": now}
    return set(connection.execute(_SQLITE_KNOWN, parameters).scalars())


def forget(connection: Connection, namespace: str, batch: Sequence[str]) -> int:
    """Delete the records of ``batch``; return how many existed."""
    deleted = 0
    for part in chunks(batch, chunk_size(connection)):
        statement = delete(tokens).where(tokens.c.namespace == namespace, tokens.c.token.in_(part))
        deleted += connection.execute(statement).rowcount
    return deleted


def lease(
    connection: Connection, namespace: str, token: str, now: float, lease_seconds: float
) -> LeaseOutcome:
    """Take an IN_PROGRESS lease, or describe the live record that prevents it."""
    if claim(connection, namespace, [token], now, lease_seconds, state=IN_PROGRESS):
        return LeaseOutcome(
            acquired=True, state=TokenState.IN_PROGRESS, expires_at=now + lease_seconds
        )
    row = connection.execute(
        select(tokens.c.state, tokens.c.result, tokens.c.expires_at).where(
            tokens.c.namespace == namespace, tokens.c.token == token
        )
    ).first()
    if row is None:  # released between our insert and this read: let the caller retry later
        return LeaseOutcome(acquired=False)
    result = json.loads(row.result) if row.result is not None else None
    return LeaseOutcome(
        acquired=False, state=TokenState(row.state), result=result, expires_at=row.expires_at
    )


def complete_lease(
    connection: Connection, namespace: str, token: str, result: Any, now: float, ttl: float
) -> None:
    """Record ``token`` DONE with its result until ``now + ttl`` (even if the lease lapsed)."""
    insert = upsert(connection, tokens)
    values = {
        "state": DONE,
        "result": json.dumps(result, separators=(",", ":"), ensure_ascii=False),
        "created_at": now,
        "expires_at": now + ttl,
    }
    connection.execute(
        insert.values(namespace=namespace, token=token, **values).on_conflict_do_update(
            index_elements=[tokens.c.namespace, tokens.c.token], set_=values
        )
    )


def renew_lease(
    connection: Connection, namespace: str, token: str, now: float, lease_seconds: float
) -> bool:
    """Move ``token``'s IN_PROGRESS expiry to ``now + lease_seconds``; False if no such lease."""
    statement = (
        update(tokens)
        .where(tokens.c.namespace == namespace, tokens.c.token == token, tokens.c.state == IN_PROGRESS)
        .values(expires_at=now + lease_seconds)
    )
    return connection.execute(statement).rowcount > 0


def release_lease(connection: Connection, namespace: str, token: str) -> None:
    """Delete ``token``'s IN_PROGRESS record (a DONE record is never released)."""
    connection.execute(
        delete(tokens).where(
            tokens.c.namespace == namespace,
            tokens.c.token == token,
            tokens.c.state == IN_PROGRESS,
        )
    )


def purge_expired(connection: Connection, now: float) -> int:
    """Delete every record expired at ``now``; return how many."""
    return connection.execute(delete(tokens).where(tokens.c.expires_at < now)).rowcount


def _on_conflict_reclaim(insert: Any) -> Any:
    """Overwrite an existing row only when it has expired; return the tokens written."""
    excluded = insert.excluded
    return insert.on_conflict_do_update(
        index_elements=[tokens.c.namespace, tokens.c.token],
        set_={
            "state": excluded.state,
            "result": excluded.result,
            "created_at": excluded.created_at,
            "expires_at": excluded.expires_at,
        },
        # excluded.created_at is "now": no extra parameter, so one cached statement serves all
        where=tokens.c.expires_at < excluded.created_at,
    ).returning(tokens.c.token)


# PostgreSQL: the whole batch travels as one array parameter, so the statement text
# stays constant (prepared and cached) whatever the batch size.
_TOKEN_ARRAY = bindparam("tokens", type_=postgresql.ARRAY(String))
_POSTGRES_CLAIM = _on_conflict_reclaim(
    postgresql.insert(tokens).from_select(
        ["namespace", "token", "state", "result", "created_at", "expires_at"],
        select(
            bindparam("namespace", type_=String),
            func.unnest(_TOKEN_ARRAY).column_valued("token"),
            bindparam("state", type_=String),
            null(),
            bindparam("now", type_=Double),
            bindparam("expires_at", type_=Double),
        ),
    )
)
# The usual batch: the tokens as one text of lines (no token holds a line break), the claimed
# ones back as one row (their count, and their lines when not all were claimed).
_CLAIMED = _on_conflict_reclaim(
    postgresql.insert(tokens).from_select(
        ["namespace", "token", "state", "result", "created_at", "expires_at"],
        select(
            bindparam("namespace", type_=String),
            func.unnest(func.string_to_array(bindparam("lines", type_=String), literal("\n"))).column_valued("token"),
            bindparam("state", type_=String),
            null(),
            bindparam("now", type_=Double),
            bindparam("expires_at", type_=Double),
        ),
    )
).cte("claimed")
_POSTGRES_CLAIM_LINES = select(func.count(), func.string_agg(_CLAIMED.c.token, literal("\n")))
_ONE_ROW = {
    "namespace": bindparam("namespace", type_=String),
    "token": bindparam("token", type_=String),
    "state": bindparam("state", type_=String),
    "result": null(),
    "created_at": bindparam("now", type_=Double),
    "expires_at": bindparam("expires_at", type_=Double),
}
_POSTGRES_CLAIM_ONE = _on_conflict_reclaim(postgresql.insert(tokens).values(**_ONE_ROW))
_POSTGRES_KNOWN = select(tokens.c.token).where(
    tokens.c.namespace == bindparam("namespace", type_=String),
    tokens.c.token == any_(_TOKEN_ARRAY),
    tokens.c.state == bindparam("done", type_=String),
    tokens.c.expires_at >= bindparam("now", type_=Double),
)

# SQLite: the batch travels as one JSON array read back with json_each, for the same
# reason (and no bound-parameter limit). "WHERE true" keeps INSERT ... SELECT ... ON
# CONFLICT unambiguous for SQLite's parser.
_SQLITE_TOKENS = func.json_each(bindparam("tokens", type_=String)).table_valued("value")
_SQLITE_CLAIM = _on_conflict_reclaim(
    sqlite.insert(tokens).from_select(
        ["namespace", "token", "state", "result", "created_at", "expires_at"],
        select(
            bindparam("namespace", type_=String),
            _SQLITE_TOKENS.c.value,
            bindparam("state", type_=String),
            null(),
            bindparam("now", type_=Double),
            bindparam("expires_at", type_=Double),
        ).where(true()),
    )
)
_SQLITE_CLAIM_ONE = _on_conflict_reclaim(sqlite.insert(tokens).values(**_ONE_ROW))
_SQLITE_KNOWN = select(tokens.c.token).where(
    tokens.c.namespace == bindparam("namespace", type_=String),
    tokens.c.token.in_(select(_SQLITE_TOKENS.c.value)),
    tokens.c.state == bindparam("done", type_=String),
    tokens.c.expires_at >= bindparam("now", type_=Double),
)
