"""Which store URLs are accepted, and what a database error means.

How each database is tuned lives with its other primitives
(`backends.store.sqlite`, `backends.store.postgresql`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TypeVar

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError

from backends.errors import ConfigurationError, UnsupportedURLError
from backends.urls import redact

T = TypeVar("T")

ALLOWED_SCHEMES = ("sqlite", "postgresql", "postgresql+psycopg")


def parse_store_url(url: str) -> URL:
    """The SQLAlchemy URL for ``url``, plain ``postgresql://`` mapped to psycopg 3."""
    allowed = ", ".join(ALLOWED_SCHEMES)
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise UnsupportedURLError(
            f"store URL {redact(url)!r} cannot be parsed; allowed schemes: {allowed}"
        ) from exc
    shown = redact(url)
    if parsed.drivername not in ALLOWED_SCHEMES:
        raise UnsupportedURLError(
            f"store URL {shown!r} has scheme {parsed.drivername!r}; allowed schemes: {allowed}"
        )
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise ConfigurationError(
            f"store URL {shown!r} is an in-memory SQLite database, which each pooled connection "
            "would see empty; use a file, e.g. sqlite:///./.reliable/store.db"
        )
    return parsed


def is_unavailable(exc: BaseException) -> bool:
    """True when a database error means "cannot reach / use the database right now"."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


REFUSED_SQLSTATES = ("28", "3D000")
"""SQLSTATEs (a class, or one code) of a server refusing the store URL itself: class 28, invalid
authorization (a wrong password, an unknown role, no ``pg_hba.conf`` entry), and 3D000, a
database that does not exist. No wait fixes them (`backends.refusal`)."""

_REFUSED_WORDS = re.compile(
    r'FATAL:  (\w+ authentication failed for user|role ".*" (does not exist|is not permitted to log in)'
    r'|database ".*" does not exist|no pg_hba\.conf entry for|pg_hba\.conf rejects connection)')
"""The server's words for those SQLSTATEs: libpq keeps no SQLSTATE for a connection the
server refused (psycopg reports ``sqlstate`` None, psycopg/psycopg#1188), so its message,
in the server's default English, stands for it. A server set to another language is not
recognised: its refusals stay outages, as before."""


def refusal(exc: BaseException) -> str | None:
    """The server's words when ``exc`` is the database refusing the store URL (`REFUSED_SQLSTATES`);
    None for any other error."""
    if not isinstance(exc, DBAPIError):
        return None
    words = str(exc.orig).strip()
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate:  # a driver that keeps it
        return words if sqlstate.startswith(REFUSED_SQLSTATES) else None
    connection = getattr(exc.orig, "pgconn", None)  # psycopg: the connection that failed to open
    if connection is not None and connection.needs_password:  # asked for one, the URL has none
        return words
    return words if _REFUSED_WORDS.search(words) else None


SQLITE_FULL = 13
"""SQLite's primary result code for "database or disk is full"."""

POSTGRESQL_DISK_FULL = "53100"
"""PostgreSQL's SQLSTATE ``disk_full``."""


def is_disk_full(exc: BaseException) -> bool:
    """True when a database refused a write because its disk is full: an outage, whatever
    statement met it (the handler's own included), over once space is back."""
    if not isinstance(exc, DBAPIError):
        return False
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF == SQLITE_FULL:
        return True
    return getattr(exc.orig, "sqlstate", None) == POSTGRESQL_DISK_FULL


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
