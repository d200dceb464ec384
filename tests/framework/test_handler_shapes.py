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


def three(msg, tx, extra):  # type: ignore[no-untyped-def]
    pass


def keyed(msg, *, flag):  # type: ignore[no-untyped-def]
    pass


def keyword_only(*, msg):  # type: ignore[no-untyped-def]
    pass


def nothing():  # type: ignore[no-untyped-def]
    pass


@pytest.mark.parametrize(("func", "shown"), [
    (three, r"takes \(msg, tx, extra\)"),
    (keyed, r"takes \(msg, \*, flag\)"),
    (keyword_only, r"takes \(\*, msg\)"),
    (nothing, r"takes \(\)"),
])
def test_a_signature_the_message_cannot_be_passed_to_is_refused_at_decoration(
        app: App, func: object, shown: str) -> None:
    """Accepted, such a handler failed every message with a TypeError, dead-lettered one by one."""
    with pytest.raises(HandlerOptionError, match=shown + r"; it must accept the message: write "
                                                 r"def handler\(msg\) or def handler\(msg, tx\)"):
        app.handler("orders")(func)  # type: ignore[arg-type]
    assert app.handlers == {}


def test_signatures_with_defaults_and_star_args_still_register(app: App) -> None:
    app.handler("orders", name="one")(lambda msg, retries=3: None)
    app.handler("orders", name="two")(lambda msg, tx, *, note="": None)
    app.handler("orders", name="many")(lambda *args: None)
    assert [h._takes_tx for h in app.handlers.values()] == [True, True, True]
    app.handler("orders", name="alone")(lambda msg, *, note="": None)
    assert app.handlers["alone"]._takes_tx is False


def test_the_decorator_without_its_topic_is_refused_naming_the_fix(app: App) -> None:
    """``@app.handler`` bare used to leave nothing registered, and `reliable run` then said only
    "no handler is registered on this app"."""
    def charge(msg: Message) -> None:
        pass

    with pytest.raises(HandlerOptionError, match=r'@app.handler needs the topic: write '
                                                 r'@app.handler\("TOPIC", \.\.\.\) above def charge'):
        app.handler(charge)  # type: ignore[arg-type]
