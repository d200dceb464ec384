"""A poison message is dead-lettered once, whatever reaches the handler again.

Its duplicate (the same token published twice) and its redelivery after a
crash between the dead-letter record's commit and the ack both find the
record already written: acked as duplicates, no second record. Batch mode
with the store down defers (does not dead-letter) what it could not record.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from backends.types import (
    CONTENT_TYPE,
    JSON,
    DeadLetter,
    Failure,
    Message,
    OutgoingMessage,
    text_bytes,
    text_from_bytes,
)
from reliable import App
from reliable.testing import test_app


def poison_app(tmp_path, store: str | None, batch: int | None) -> App:
    app = test_app(tmp_path, store=store)
    options = {"batch": batch} if batch else {}

    @app.handler("payments", group="billing", token="body.id", fatal=(ValueError,), **options)
    def charge(msg, tx=None):
        raise ValueError("amount must be positive")

    return app


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@pytest.mark.parametrize("batch", [None, 10])
def test_a_duplicate_of_a_poison_message_is_not_dead_lettered_again(tmp_path, request, unique, backend, batch):
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = poison_app(tmp_path, store, batch)
    token = f"p-{unique}"
    app.publish("payments", {"id": token})
    app.run(until_idle=True)
    app.publish("payments", {"id": token})  # the producer sent it twice
    app.run(until_idle=True)
    letters = [letter for letter in app.dead_letters("billing") if letter.token == token]
    assert len(letters) == 1
    assert (app.stats()["dead_lettered"], app.stats()["duplicate"]) == (1, 1)
    app.close()


def test_a_replayed_dead_letter_that_fails_again_gets_a_record_of_its_own(tmp_path, unique):
    app = poison_app(tmp_path, None, None)
    app.publish("payments", {"id": unique})
    app.run(until_idle=True)
    assert app.replay_dead_letters("billing") == 1
    app.run(until_idle=True)
    (letter,) = app.dead_letters("billing")
    assert letter.replays == 1 and app.stats()["dead_lettered"] == 2
    app.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_error_quoting_a_nul_character_is_recorded_with_it_written_out(tmp_path, request, unique, backend):
    """PostgreSQL's text cannot hold NUL: the record's insert used to fail, and its error
    stopped the worker (app.run raised) with the message never dead-lettered."""
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = test_app(tmp_path, store=store)

    @app.handler("customers", group=unique, token="body.id", fatal=(ValueError,))
    def register(msg, tx):
        raise ValueError(f"name {msg.body['name']} has a control character")

    app.publish("customers", {"id": unique, "name": "a\u0000b"})
    app.run(until_idle=True)
    (letter,) = app.dead_letters(unique)
    assert letter.failure.error_message == "name a\\x00b has a control character"
    assert "name a\\x00b has" in letter.failure.traceback and "\x00" not in letter.failure.traceback
    assert app.stats()["dead_lettered"] == 1
    app.close()


HOSTILE = {  # what any producer can send: ids and keys PostgreSQL's columns cannot hold as they are
    "a NUL in the key": {"key": "k\x00ey", "message_id": "with-a-nul-key"},
    "a NUL in the message id": {"message_id": "m\x00id"},
    "an id wider than its column": {"message_id": "m" * 300},
}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_message_id_or_key_the_columns_cannot_hold_is_recorded_and_replayed_exactly(
    tmp_path, request, unique, backend
):
    """Each record used to fail on PostgreSQL (a DataError, not an outage): app.run raised and
    every restart did the same, so one producer stopped the worker."""
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = test_app(tmp_path, store=store)
    seen: list[tuple[str, str | None]] = []

    @app.handler(unique, group=unique, token="body.n", fatal=(ValueError,))
    def record(msg, tx):
        seen.append((msg.id, msg.key))
        if msg.body["n"] < len(HOSTILE):
            raise ValueError("not today")

    sent = [OutgoingMessage(f'{{"n": {n}}}'.encode(), headers={CONTENT_TYPE: JSON}, **fields)
            for n, fields in enumerate([*HOSTILE.values(), {"message_id": f"ok-{unique}"}])]
    app.transport.publish(unique, sent)
    app.run(until_idle=True)

    exact = sorted(((m.message_id, m.key) for m in sent[:-1]), key=repr)
    assert sorted(seen, key=repr) == sorted([*exact, (f"ok-{unique}", None)], key=repr) and app.stats()["dead_lettered"] == 3
    assert sorted(((letter.message.id, letter.message.key) for letter in app.dead_letters(unique)), key=repr) == exact
    seen.clear()
    assert app.replay_dead_letters(unique) == 3
    app.run(until_idle=True)
    assert sorted(seen, key=repr) == exact  # the replay sent each message exactly as it came
    assert sorted(((letter.message.id, letter.message.key) for letter in app.dead_letters(unique)), key=repr) == exact
    app.close()


def test_a_dead_letter_table_made_before_the_exact_column_gets_it(tmp_path, unique):
    app = test_app(tmp_path)
    with app.store.transaction() as tx:  # makes the tables
        tx.execute(text("ALTER TABLE reliable_dead_letters DROP COLUMN exact"))  # as an older version made it
    app.close()
    app = test_app(tmp_path)  # the same database, opened by this version

    @app.handler(unique, group=unique, fatal=(ValueError,))
    def refuse(msg, tx):
        raise ValueError("not today")

    app.transport.publish(unique, [OutgoingMessage(b"{}", key="k\x00", headers={CONTENT_TYPE: JSON})])
    app.run(until_idle=True)
    assert [letter.message.key for letter in app.dead_letters(unique)] == ["k\x00"]
    app.close()


def test_a_dead_letter_table_made_before_replays_held_letters_gets_the_column(tmp_path, unique):
    app = test_app(tmp_path)
    with app.store.transaction() as tx:  # makes the tables
        tx.execute(text("ALTER TABLE reliable_dead_letters DROP COLUMN replaying_until"))  # as an older version
    app.close()
    app = test_app(tmp_path)  # the same database, opened by this version

    @app.handler(unique, group=unique, fatal=(ValueError,))
    def refuse(msg, tx):
        raise ValueError("not today")

    app.publish(unique, {"n": 1})
    app.run(until_idle=True)
    assert app.replay_dead_letters(unique) == 1
    app.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_binary_key_header_and_an_error_quoting_them_are_recorded_exactly(tmp_path, request, unique, backend):
    """A Kafka key or header value that is not UTF-8 is text with lone surrogates (`text_from_bytes`),
    which no store's text column holds: stored readably or escaped, read back as it came."""
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = test_app(tmp_path, store=store)
    key = text_from_bytes(b"\x00\x00\x01\x80\xff")
    headers = {"schema": text_from_bytes(b"\x00\x01\xa7"), "text": "é"}
    message = Message(id=f"m-{unique}", topic=unique, queue=0, offset=7, payload=b"{}", key=key, headers=headers)
    failure = Failure("ValueError", f"no such customer {key}", f"Traceback: {key}", 1, 1.0, 2.0)
    with app.store.transaction() as tx:
        assert tx.add_dead_letter(DeadLetter(unique, message, None, failure)) is not None

    (letter,) = app.dead_letters(unique)
    assert letter.message.key == key and text_bytes(letter.message.key) == b"\x00\x00\x01\x80\xff"
    assert letter.message.headers == headers
    assert letter.failure.error_message == "no such customer \\x00\\x00\x01\\x80\\xff"
    with app.store.transaction() as tx:  # the column holds the readable stand-in
        stored = tx.execute(text("SELECT key FROM reliable_dead_letters WHERE topic = :t"), {"t": unique})
        assert stored.scalar_one().startswith("\\x00\\x00\x01\\x80\\xff~")
    app.close()
