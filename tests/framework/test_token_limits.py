"""A token the store cannot record is poison at once, on SQLite and PostgreSQL alike.

PostgreSQL refuses a token wider than the token column or holding a NUL
character; before tokens were checked, such a message was retried and
redelivered until its attempts were spent, and then its dead-letter record
(which holds the token too) was refused as well, which stopped the worker.
"""

from __future__ import annotations

import pytest

from backends.store.schema import TOKEN_MAX
from reliable import App, Message
from reliable.testing import test_app


@pytest.fixture(params=["sqlite", "postgresql"])
def app(request, tmp_path) -> App:
    store = request.getfixturevalue("postgres_url") if request.param == "postgresql" else None
    app = test_app(tmp_path, store=store)
    yield app
    app.close()


def test_a_token_the_store_cannot_record_is_dead_lettered_once_and_its_neighbours_run(
    app: App, unique: str
) -> None:
    ran: list[str] = []

    @app.handler(unique, group=unique, token="body.id")
    def handle(msg: Message, tx) -> None:  # type: ignore[no-untyped-def]
        ran.append(msg.body["id"])

    longest = "x" * TOKEN_MAX
    app.publish(unique, {"id": "y" * (TOKEN_MAX + 1)})
    app.publish(unique, {"id": "a\x00b"})
    app.publish(unique, {"id": longest})
    app.run(until_idle=True)

    assert ran == [longest]
    stats = app.stats()
    assert (stats["processed"], stats["dead_lettered"], stats["redelivered"]) == (1, 2, 0)
    letters = app.dead_letters(unique)
    assert [letter.failure.error_type for letter in letters] == ["reliable.errors.TokenInvalidError"] * 2
    assert [letter.failure.attempts for letter in letters] == [1, 1]
    assert f"is {TOKEN_MAX + 1} characters long; at most {TOKEN_MAX}" in letters[0].failure.error_message
    assert "body.id holds a NUL character ('a\\x00b')" in letters[1].failure.error_message
