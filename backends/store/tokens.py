"""Token records: the claim under the unique index, lookups, leases and expiry.

Every function takes an open SQLAlchemy ``Connection`` (inside a transaction),
the store's `Dialect` and the current time, so the store decides transaction
boundaries and the clock, and these stay plain statements, written once for
every database (SQLAlchemy Core, one round trip each).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, select, update

from backends.store.base import LeaseOutcome, TokenState
from backends.store.claims import DONE, IN_PROGRESS, Claim
from backends.store.dialect import Dialect
from backends.store.engine import chunks
from backends.store.schema import tokens


def claim(
    connection: Connection,
    dialect: Dialect,
    namespace: str,
    batch: Sequence[str],
    now: float,
    ttl: float,
    state: str = DONE,
) -> set[str]:
    """Insert ``batch`` (distinct, in lock order); return the tokens inserted or reclaimed from
    expired rows (see `backends.store.claims`)."""
    if not batch:
        return set()
    claimed = dialect.claim(connection, Claim(namespace, batch, now, now + ttl, state))
    assert claimed is not None, "the last claim path of a dialect decides every batch"
    return claimed


def forget(connection: Connection, dialect: Dialect, namespace: str, batch: Sequence[str]) -> int:
    """Delete the records of ``batch``; return how many existed."""
    deleted = 0
    for part in chunks(batch, dialect.chunk):
        statement = delete(tokens).where(tokens.c.namespace == namespace, tokens.c.token.in_(part))
        deleted += connection.execute(statement).rowcount
    return deleted


def lease(
    connection: Connection, dialect: Dialect, namespace: str, token: str, now: float, lease_seconds: float
) -> LeaseOutcome:
    """Take an IN_PROGRESS lease, or describe the live record that prevents it."""
    if claim(connection, dialect, namespace, [token], now, lease_seconds, state=IN_PROGRESS):
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
    connection: Connection, dialect: Dialect, namespace: str, token: str, result: Any, now: float, ttl: float
) -> None:
    """Record ``token`` DONE with its result until ``now + ttl`` (even if the lease lapsed)."""
    values = {
        "state": DONE,
        "result": json.dumps(result, separators=(",", ":"), ensure_ascii=False),
        "created_at": now,
        "expires_at": now + ttl,
    }
    connection.execute(
        dialect.insert(tokens).values(namespace=namespace, token=token, **values).on_conflict_do_update(
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
