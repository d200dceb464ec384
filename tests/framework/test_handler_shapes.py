"""No silent handler shapes: what cannot be run to completion is refused, never acked unhandled."""

from __future__ import annotations

import pytest

from reliable import App, Message
from reliable.errors import HandlerOptionError
from reliable.testing import dead_letter_queue

from .conftest import pending


def test_a_generator_function_is_refused_at_decoration(app: App) -> None:
    with pytest.raises(HandlerOptionError, match="'produce' is a generator function"):
        @app.handler("orders")
        def produce(msg: Message, tx):  # type: ignore[no-untyped-def]
            yield msg

    assert app.handlers == {}


def test_an_async_generator_function_is_refused_at_decoration(app: App) -> None:
    with pytest.raises(HandlerOptionError, match="'stream' is an async generator function"):
        @app.handler("orders")
        async def stream(msg: Message, tx):  # type: ignore[no-untyped-def]
            yield msg


def test_a_callable_object_with_a_generator_call_is_refused(app: App) -> None:
    class Producer:
        def __call__(self, msg: Message):  # type: ignore[no-untyped-def]
            yield msg

    with pytest.raises(HandlerOptionError, match="'Producer' is a generator function"):
        app.handler("orders")(Producer())


def test_a_non_callable_is_refused_at_decoration(app: App) -> None:
    with pytest.raises(HandlerOptionError, match="handler 'not a function' is not callable"):
        app.handler("orders")("not a function")  # type: ignore[arg-type]


def test_a_handler_returning_an_unrun_body_is_poison_never_processed(app: App) -> None:
    """A lambda that hands back a generator passes decoration; its body never runs, so the
    message is dead-lettered, not counted processed."""
    ran: list[str] = []

    def body(msg: Message):  # type: ignore[no-untyped-def]
        ran.append(msg.id)
        yield

    app.handler("orders", name="sneaky")(lambda msg: body(msg))
    app.publish("orders", {"id": 1})
    app.run(until_idle=True)

    assert ran == []
    stats = app.stats()
    assert stats["processed"] == 0 and stats["dead_lettered"] == 1
    [letter] = app.dead_letters("sneaky")
    assert letter.failure.error_type == "reliable.errors.HandlerShapeError"
    assert "returned generator" in letter.failure.error_message
    assert len(dead_letter_queue(app, "sneaky")) == 1
    assert pending(app, "sneaky", "orders") == 0
