"""Dead-letter records: the original message, bytes unchanged, with its failure."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Connection,
    LargeBinary,
    String,
    delete,
    func,
    inspect,
    or_,
    select,
    text,
    update,
)

from backends.store.dialect import Dialect
from backends.store.engine import chunks
from backends.store.schema import dead_letters
from backends.types import DeadLetter, Failure, Message, readable, storable


def add(connection: Connection, dialect: Dialect, letter: DeadLetter, now: float) -> int | None:
    """Insert ``letter``; its id, or None when the group already has a record of this message
    (same token, or same message id without a token) at the same replay count.

    A message id or key the columns cannot hold as they are (a NUL character, which
    PostgreSQL's text refuses; bytes that are not UTF-8, a binary Kafka key; an id wider than
    its column) is stored as a readable stand-in,
    and exactly in ``exact``: any producer can send such a message, and its record must neither
    fail (which would stop the worker) nor change what a replay sends.
    """
    message, failure = letter.message, letter.failure
    message_id, key = _Field(message.id, _MESSAGE_ID_WIDTH), _Field(message.key)
    exact = {name: field.value for name, field in (("message_id", message_id), ("key", key)) if not field.fits}
    if letter.token is not None:
        identity = f"token:{letter.token}"  # tokens are checked: they fit (`reliable.idempotency.Token`)
    elif message_id.fits:
        identity = f"message:{message.id}"
    else:
        identity = f"message-sha256:{_digest(message.id)}"
    result = connection.execute(
        dialect.insert(dead_letters)
        .values(
            identity=identity,
            group=letter.group,
            topic=message.topic,
            queue=message.queue,
            offset=message.offset,
            message_id=message_id.stored,
            key=key.stored,
            headers=_json(message.headers),
            payload=bytes(message.payload),
            published_at=message.published_at,
            token=letter.token,
            attempts=failure.attempts,
            error_type=_Field(failure.error_type, _ERROR_TYPE_WIDTH).stored,
            error_message=readable(failure.error_message),
            traceback=readable(failure.traceback),
            first_failure_at=failure.first_failure_at,
            last_failure_at=failure.last_failure_at,
            replays=letter.replays,
            created_at=now,
            exact=json.dumps(exact) if exact else None,  # JSON writes NUL as \u0000, a lone surrogate \udcNN
        )
        .on_conflict_do_nothing(index_elements=["group", "identity", "replays"])
        .returning(dead_letters.c.id)
    )
    inserted = result.scalar_one_or_none()
    return None if inserted is None else int(inserted)


_MESSAGE_ID_WIDTH = cast(String, dead_letters.c.message_id.type).length
_ERROR_TYPE_WIDTH = cast(String, dead_letters.c.error_type.type).length


class _Field:
    """A text field of a record: ``stored`` is ``value`` where the column holds it as it is
    (``fits``), else a readable stand-in (`backends.types.readable`), cut to ``width`` and ended with
    a digest of the value, so two stand-ins differ where the values do."""

    def __init__(self, value: str | None, width: int | None = None) -> None:
        self.value, self.stored = value, value
        self.fits = value is None or (storable(value) and (width is None or len(value) <= width))
        if value is not None and not self.fits:
            digest = "~" + _digest(value)[:16]
            self.stored = readable(value)[: None if width is None else width - len(digest)] + digest


def _json(headers: Mapping[str, str]) -> str:
    """The headers as JSON text, escaped to ASCII only where a value holds bytes that are not
    UTF-8 (a Kafka header: `backends.types.text_from_bytes`), which no text column holds raw."""
    compact = json.dumps(dict(headers), separators=(",", ":"), ensure_ascii=False)
    return compact if storable(compact) else json.dumps(dict(headers), separators=(",", ":"))


def _digest(text: str) -> str:
    """The SHA-256 of ``text``, in hex; a lone surrogate (a byte that was not UTF-8) counts too."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def add_late_columns(connection: Connection) -> None:
    """Give a dead-letter table created before ``identity``, ``exact`` or ``replaying_until``
    existed the column (and the index of ``identity``)."""
    columns = {column["name"] for column in inspect(connection).get_columns(dead_letters.name)}
    if "exact" not in columns:
        connection.execute(text(f"ALTER TABLE {dead_letters.name} ADD COLUMN exact TEXT"))
    if "replaying_until" not in columns:
        connection.execute(text(f"ALTER TABLE {dead_letters.name} ADD COLUMN replaying_until DOUBLE PRECISION"))
    if "identity" not in columns:
        connection.execute(text(f"ALTER TABLE {dead_letters.name} ADD COLUMN identity VARCHAR(600)"))
        connection.execute(text(
            f"CREATE UNIQUE INDEX IF NOT EXISTS reliable_dead_letters_once "
            f'ON {dead_letters.name} ("group", identity, replays)'))


def page(connection: Connection, group: str, limit: int, after_id: int,
         body_limit: int | None = None) -> list[DeadLetter]:
    """Dead letters of ``group`` with id > ``after_id``, oldest first; with ``body_limit``, each
    body cut to its first bytes in the query and its whole size beside (`DeadLetter.body_size`)."""
    columns: list[Any] = list(dead_letters.c)
    if body_limit is not None:  # substr and length count bytes of a BLOB (SQLite) or a bytea
        payload = dead_letters.c.payload
        columns = [c for c in columns if c is not payload] + [
            func.substr(payload, 1, body_limit, type_=LargeBinary).label("payload"),
            func.length(payload).label("body_size")]
    statement = (
        select(*columns)
        .where(dead_letters.c.group == group, dead_letters.c.id > after_id)
        .order_by(dead_letters.c.id)
        .limit(limit)
    )
    return [_from_row(row) for row in connection.execute(statement)]


def get(connection: Connection, letter_id: int) -> DeadLetter | None:
    """One dead letter by id."""
    row = connection.execute(select(dead_letters).where(dead_letters.c.id == letter_id)).first()
    return None if row is None else _from_row(row)


def ids_of(connection: Connection, dialect: Dialect, group: str, ids: Sequence[int] | None,
           min_replays: int) -> list[int]:
    """The ids of ``group``'s dead letters (of ``ids`` only, when given) replayed at least
    ``min_replays`` times, in order: ids only, so a selection of many letters stays small."""
    statement = select(dead_letters.c.id).where(dead_letters.c.group == group)
    if ids is not None:
        statement = statement.where(dialect.among(dead_letters.c.id, list(ids)))
    if min_replays > 0:
        statement = statement.where(dead_letters.c.replays >= min_replays)
    return [int(letter_id) for letter_id in connection.execute(statement.order_by(dead_letters.c.id)).scalars()]


def take(connection: Connection, dialect: Dialect, group: str, ids: Sequence[int], now: float,
         until: float) -> list[DeadLetter]:
    """Hold, until ``until``, those of ``ids`` that are ``group``'s dead letters and no replay holds
    at ``now``; them, oldest first. One short write: the replay sends them after it commits."""
    statement = (
        update(dead_letters)
        .where(dead_letters.c.group == group, dialect.among(dead_letters.c.id, list(ids)), _free(now))
        .values(replaying_until=until)
        .returning(*dead_letters.c)
    )
    return sorted((_from_row(row) for row in connection.execute(statement)), key=lambda letter: letter.id or 0)


def settle(connection: Connection, dialect: Dialect, sent: Sequence[int], unsent: Sequence[int]) -> int:
    """After a replay's send: delete the ``sent`` letters, let go of the ``unsent`` ones (refused,
    or not reached); how many were deleted."""
    for part in chunks(unsent, dialect.chunk):
        connection.execute(update(dead_letters).where(dead_letters.c.id.in_(part)).values(replaying_until=None))
    return remove(connection, dialect, sent)


def remove(connection: Connection, dialect: Dialect, ids: Sequence[int], now: float | None = None) -> int:
    """Delete dead letters by id (with ``now``: those no replay holds then); return how many."""
    deleted = 0
    for part in chunks(ids, dialect.chunk):
        statement = delete(dead_letters).where(dead_letters.c.id.in_(part))
        deleted += connection.execute(statement if now is None else statement.where(_free(now))).rowcount
    return deleted


def _free(now: float) -> ColumnElement[bool]:
    """No replay holds the letter at ``now`` (none took it, or the one that did let go or died)."""
    return or_(dead_letters.c.replaying_until.is_(None), dead_letters.c.replaying_until <= now)


def count(connection: Connection, group: str) -> int:
    """How many dead letters ``group`` has."""
    statement = select(func.count()).select_from(dead_letters).where(dead_letters.c.group == group)
    return int(connection.execute(statement).scalar_one())


def groups(connection: Connection) -> list[str]:
    """The groups that have dead letters, by name."""
    statement = select(dead_letters.c.group).distinct().order_by(dead_letters.c.group)
    return [str(name) for name in connection.execute(statement).scalars()]


def mark_replayed(connection: Connection, dialect: Dialect, ids: Sequence[int]) -> int:
    """Add one to the replay count of each dead letter in ``ids``; return how many."""
    changed = 0
    for part in chunks(ids, dialect.chunk):
        statement = (
            update(dead_letters)
            .where(dead_letters.c.id.in_(part))
            .values(replays=dead_letters.c.replays + 1)
        )
        changed += connection.execute(statement).rowcount
    return changed


def _from_row(row: Any) -> DeadLetter:
    exact = json.loads(row.exact) if row.exact else {}
    message = Message(
        id=exact.get("message_id", row.message_id),
        topic=row.topic,
        queue=row.queue,
        offset=row.offset,
        payload=bytes(row.payload),
        key=exact.get("key", row.key),
        headers=json.loads(row.headers),
        attempt=row.attempts,
        published_at=row.published_at,
        first_failure_at=row.first_failure_at,
    )
    failure = Failure(
        error_type=row.error_type,
        error_message=row.error_message,
        traceback=row.traceback,
        attempts=row.attempts,
        first_failure_at=row.first_failure_at,
        last_failure_at=row.last_failure_at,
    )
    return DeadLetter(
        group=row.group,
        message=message,
        token=row.token,
        failure=failure,
        id=row.id,
        replays=row.replays,
        body_size=row._mapping.get("body_size"),
    )
