"""The store's tables: tokens, offsets, dead letters, batch fences, the write probe and the outbox
(SQLAlchemy Core).

Times are epoch seconds (floats) from the injected clock, never the database's
own ``now()``, so a fake clock drives expiry in tests and every process agrees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Engine,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    text,
)

if TYPE_CHECKING:
    from backends.store.dialect import Dialect

metadata = MetaData()

TOKEN_MAX = 512
"""The longest token the store records, in characters (the token columns' width)."""


def _identifier(length: int) -> String:
    """Text compared byte by byte: tokens are identifiers, not words to sort for people.

    On PostgreSQL the ``"C"`` collation makes every comparison in the primary
    key a ``memcmp`` instead of a locale-aware one (SQLite's default is
    already binary).
    """
    return String(length).with_variant(String(length, collation="C"), "postgresql")


# The idempotency heart: the primary key on (namespace, token) is the unique
# index a concurrent twin waits on. Expiry follows insertion order, so on
# PostgreSQL a BRIN index serves the purge at almost no cost per insert
# (a B-tree elsewhere).
tokens = Table(
    "reliable_tokens",
    metadata,
    Column("namespace", _identifier(255), nullable=False),
    Column("token", _identifier(TOKEN_MAX), nullable=False),
    Column("state", String(16), nullable=False),
    Column("result", Text, nullable=True),  # JSON text (lease mode)
    Column("created_at", Double, nullable=False),
    Column("expires_at", Double, nullable=False),
    PrimaryKeyConstraint("namespace", "token", name="reliable_tokens_pk"),
    Index("reliable_tokens_expires_at", "expires_at", postgresql_using="brin"),
)

offsets = Table(
    "reliable_offsets",
    metadata,
    Column("group", String(255), nullable=False),
    Column("topic", String(255), nullable=False),
    Column("queue", Integer, nullable=False),
    Column("next_offset", BigInteger, nullable=False),
    PrimaryKeyConstraint("group", "topic", "queue", name="reliable_offsets_pk"),
)

dead_letters = Table(
    "reliable_dead_letters",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("group", String(255), nullable=False),
    Column("topic", String(255), nullable=False),
    Column("queue", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("message_id", String(255), nullable=False),
    Column("key", Text, nullable=True),
    Column("headers", Text, nullable=False),  # JSON object text
    Column("payload", LargeBinary, nullable=False),  # the bytes exactly as published
    Column("published_at", Double, nullable=False, default=0.0),
    Column("token", String(TOKEN_MAX), nullable=True),
    Column("attempts", Integer, nullable=False),
    Column("error_type", String(255), nullable=False),
    Column("error_message", Text, nullable=False),
    Column("traceback", Text, nullable=False),
    Column("first_failure_at", Double, nullable=False),
    Column("last_failure_at", Double, nullable=False),
    Column("replays", Integer, nullable=False, default=0),
    Column("created_at", Double, nullable=False),
    # the message's identity for the group: its token, else its message id; with ``replays``
    # unique, so a message dead-lettered twice (a duplicate of a poison message, a redelivery
    # after a crash between the record's commit and the ack) keeps one record
    Column("identity", String(600), nullable=True),
    # the message's id and key exactly, as a JSON object, where the columns above could only hold
    # a readable stand-in (a NUL character, an id wider than its column: any producer can send one)
    Column("exact", Text, nullable=True),
    # until when a replay holds the letter while it sends it (`backends.store.deadletters.take`):
    # another replay skips it and a purge leaves it; a replay that died lets go at this time
    Column("replaying_until", Double, nullable=True),
    Index("reliable_dead_letters_group", "group", "id"),
    Index("reliable_dead_letters_once", "group", "identity", "replays", unique=True),
    sqlite_autoincrement=True,  # ids are never reused after a purge (PostgreSQL: a sequence)
)

fences = Table(
    "reliable_fences",
    metadata,
    Column("name", String(255), nullable=False),
    Column("batch_id", BigInteger, nullable=False),
    Column("run_id", String(255), nullable=False),
    Column("recorded_at", Double, nullable=False),
    PrimaryKeyConstraint("name", "batch_id", name="reliable_fences_pk"),
)

# One row, replaced by every write probe (`Store.ping_write`): what a worker holding its fetches
# after a full disk writes to learn that the store takes writes again (`Dialect.ping_write`).
write_probe = Table(
    "reliable_write_probe",
    metadata,
    Column("written_at", Double, nullable=False),
)

# The transactional outbox: rows a transaction writes (`Transaction.publish`) that a relay
# publishes once they are committed. Rows belong to one named ``outbox`` (apps that share a
# database but not a transport keep apart); ``id`` orders the rows of a key (writers of one key
# that do not overlap commit in id order). The ``message_id`` a row is sent with is drawn when
# it is written, so every resend carries the same one. The partial indexes cover only what a
# relay looks for: unsent rows.
outbox = Table(
    "reliable_outbox",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("outbox", _identifier(255), nullable=False),
    Column("message_id", String(64), nullable=False, unique=True),
    Column("topic", String(255), nullable=False),
    Column("key", _identifier(512), nullable=True),
    Column("headers", Text, nullable=False),  # JSON object text
    Column("payload", LargeBinary, nullable=False),  # the bytes to publish, exactly
    Column("deliver_at", Double, nullable=False),  # written at + the publish's delay
    Column("state", String(16), nullable=False),  # backends.store.outbox.RowState
    Column("created_at", Double, nullable=False),
    Column("sent_at", Double, nullable=True),
    Column("error", Text, nullable=True),  # why the transport refused a FAILED row
    Index("reliable_outbox_pending", "outbox", "id",
          postgresql_where=text("state = 'pending'"), sqlite_where=text("state = 'pending'")),
    Index("reliable_outbox_unsent_key", "outbox", "key", "id",
          postgresql_where=text("state <> 'sent'"), sqlite_where=text("state <> 'sent'")),
    Index("reliable_outbox_failed", "outbox", "key", "id",
          postgresql_where=text("state = 'failed'"), sqlite_where=text("state = 'failed'")),
    Index("reliable_outbox_sent", "outbox", "sent_at"),  # SENT rows kept here (SQLite, or an earlier version)
    sqlite_autoincrement=True,  # ids only grow, also after the newest rows were purged
)

# The rows the transport confirmed, moved out of ``reliable_outbox`` on PostgreSQL (deleted
# there, inserted here in the relay's transaction) and kept for the retention: a delete and an
# insert into a table of two indexes cost it far less than updating the row in place, which
# gives it a new version in three of the outbox's indexes. SQLite updates them in place, which
# writes fewer pages there (`Dialect.mark_sent`). Reading and purging look at both tables.
outbox_sent = Table(
    "reliable_outbox_sent_rows",
    metadata,
    *(Column(c.name, c.type, nullable=c.nullable) for c in outbox.columns),
    PrimaryKeyConstraint("outbox", "id", name="reliable_outbox_sent_rows_pk"),
    Index("reliable_outbox_sent_rows_at", "outbox", "sent_at"),
    # a message id chosen by the caller (tx.publish(message_id=...)) is refused while a sent row
    # of it is kept, as it was while sent rows stayed under reliable_outbox's unique index
    Index("reliable_outbox_sent_rows_message_id", "message_id"),
)


def add_late_indexes(bind: Engine, dialect: Dialect) -> None:
    """Give a table of sent rows made before its last index that index (``create_all`` leaves an
    existing table as it is)."""
    for index in outbox_sent.indexes:
        dialect.add_index(bind, index)
