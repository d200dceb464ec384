"""A poison message is dead-lettered once, whatever reaches the handler again.

Its duplicate (the same token published twice) and its redelivery after a
crash between the dead-letter record's commit and the ack both find the
record already written: acked as duplicates, no second record. Batch mode
with the store down defers (does not dead-letter) what it could not record.
"""

from __future__ import annotations

import pytest

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
