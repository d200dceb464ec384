"""A redelivery after a crash between the dead-letter record's commit and the POISON ack
writes no second record (SQLite and PostgreSQL): the pipeline sees the very same message
again, as the transport hands it back when the member died before acking."""

from __future__ import annotations

import pytest

from reliable.middleware import Middleware
from reliable.outcome import Outcome
from reliable.pipeline import Pipeline
from reliable.testing import test_app


class Seen(Middleware):
    def __init__(self) -> None:
        self.outcomes_seen: list[Outcome] = []
        self.latencies: list[int] = []

    def after_message(self, handler, message, result) -> None:
        self.outcomes_seen.append(result.outcome)

    def after_handler(self, handler, messages, seconds, error) -> None:
        self.latencies.append(len(messages))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@pytest.mark.parametrize("mode", [{}, {"batch": 5}, {"lease": 30.0}])
def test_a_redelivered_poison_message_is_recorded_once(tmp_path, request, unique, backend, mode) -> None:
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = test_app(tmp_path, store=store)

    @app.handler("payments", group=unique, token="body.id", fatal=(ValueError,), **mode)
    def charge(msg, tx=None):
        raise ValueError("amount must be positive")

    app.publish("payments", {"id": "p-1"})
    with app.transport.subscribe(unique, ["payments"]) as subscription:
        (message,) = subscription.fetch(1, 1.0)
    charge.config = app.config_for(charge)
    pipeline = Pipeline(charge, app.runtime)
    seen = Seen()
    pipeline.middleware.add(seen)

    pipeline.process([message])  # recorded; the member dies before the POISON ack...
    pipeline.process([message])  # ...and the transport hands the same message back

    assert seen.outcomes_seen == [Outcome.DEAD_LETTERED, Outcome.DUPLICATE]
    assert len(seen.latencies) >= 2  # the handler ran both times (observed): only the record is once
    assert [letter.message.id for letter in app.dead_letters(unique)] == [message.id]
    app.close()
