"""Errors no retry can fix are fatal by default: dead-lettered at once, with their cause."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from reliable import App, Message
from reliable.testing import test_app


@pytest.fixture
def app(tmp_path, postgres_url: str, request) -> App:
    store = postgres_url if request.param == "postgresql" else None
    made = test_app(tmp_path, store=store)
    yield made
    made.close()


@pytest.mark.parametrize("app", ["sqlite", "postgresql"], indirect=True)
def test_a_missing_table_is_dead_lettered_at_once(app: App, unique: str) -> None:
    calls: list[int] = []

    @app.handler("orders", group=unique, token="body.id")
    def handle(msg: Message, tx) -> None:
        calls.append(msg.attempt)
        tx.execute(text("insert into table_nobody_created (id) values (:id)"), {"id": msg.body["id"]})

    app.publish("orders", {"id": "o1"})
    app.run(until_idle=True)
    (letter,) = app.dead_letters(unique)
    assert calls == [1]  # no in-process retry, no redelivery
    assert "table_nobody_created" in letter.failure.error_message
    assert letter.failure.error_type.startswith("sqlalchemy.exc.")


@pytest.mark.parametrize("app", ["sqlite"], indirect=True)
def test_bugs_are_fatal_unless_the_handler_says_retry(app: App) -> None:
    calls: dict[str, int] = {"bug": 0, "retried": 0}

    @app.handler("a", token="body.id")
    def bug(msg: Message, tx) -> None:
        calls["bug"] += 1
        None.missing  # noqa: B018  # AttributeError: a bug, not a transient failure

    @app.handler("b", token="body.id", retry_on=(AttributeError,), in_process=2)
    def retried(msg: Message, tx) -> None:
        calls["retried"] += 1
        if calls["retried"] < 2:
            None.missing  # noqa: B018
        return None

    app.publish("a", {"id": 1})
    app.publish("b", {"id": 1})
    app.run(until_idle=True)
    assert calls == {"bug": 1, "retried": 2}
    assert len(app.dead_letters("bug")) == 1 and app.dead_letters("retried") == []
