"""What a new user sees in the log: the traceback (file and line) of a retried or dead-lettered failure."""

from __future__ import annotations

import io
import json

import pytest
import structlog
from structlog.testing import capture_logs

from reliable import App, Message
from reliable.log import configure_logging

CARD = "-".join(["4242"] * 4)  # built, so the source lines a console traceback shows do not hold it


def test_dead_letter_and_retry_logs_carry_the_traceback(app: App) -> None:
    calls: list[str] = []

    @app.handler("orders", token="body.id", in_process=2, fatal=[KeyError])
    def handle(msg: Message) -> None:
        calls.append(msg.body["id"])
        if msg.body["id"] == "flaky" and calls.count("flaky") == 1:
            raise ConnectionError("try again")
        if msg.body["id"] == "bad":
            raise KeyError("no such customer")  # this line is what the log must point at

    app.publish("orders", {"id": "bad"})
    app.publish("orders", {"id": "flaky"})
    with capture_logs() as logs:
        app.run(until_idle=True)

    [dead] = [e for e in logs if e["event"] == "dead_lettered"]
    assert isinstance(dead["exc_info"], KeyError)
    frames = [(f.f_code.co_filename, f.f_lineno) for f, _ in _walk(dead["exc_info"].__traceback__)]
    assert any(name.endswith("test_logged_failures.py") for name, _ in frames)
    [retried] = [e for e in logs if e["event"] == "retrying_in_process"]
    assert isinstance(retried["exc_info"], ConnectionError)


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_the_logged_traceback_names_the_line_and_keeps_no_locals(app: App, fmt: str) -> None:
    """A handler's locals hold message bodies (customer data): the log shows where it failed, not them."""

    @app.handler("orders", token="body.id", fatal=[KeyError])
    def handle(msg: Message) -> None:
        card = msg.body["card"]  # noqa: F841 - a local the log must not show
        raise KeyError("no such customer")

    app.publish("orders", {"id": "o-1", "card": CARD})
    out = io.StringIO()
    configure_logging("info", fmt, out)
    try:
        app.run(until_idle=True)
    finally:
        structlog.reset_defaults()
    text = out.getvalue()
    assert "no such customer" in text and "test_logged_failures.py" in text
    assert CARD not in text
    if fmt == "json":
        [dead] = [e for e in map(json.loads, text.splitlines()) if e["event"] == "dead_lettered"]
        frames = dead["exception"][0]["frames"]
        assert frames[-1]["name"] == "handle" and "locals" not in frames[-1]


def _walk(tb):  # type: ignore[no-untyped-def]
    import traceback

    return traceback.walk_tb(tb)


def test_a_worker_waiting_for_a_redelivery_says_so_once(app: App) -> None:
    """`run(until_idle=True)` (`reliable run --until-idle`) waiting out a redelivery delay logged
    nothing after `redelivery_scheduled`: ten minutes of silence for a 600 s delay."""
    import reliable

    attempts: list[int] = []

    @app.handler("orders", token="body.id", in_process=1,
                 retry=reliable.RedeliveryPolicy(initial_delay=60, multiplier=2, max_redeliveries=2))
    def handle(msg: Message) -> None:
        attempts.append(msg.attempt)
        if msg.attempt < 3:
            raise ConnectionError("gateway down")

    app.publish("orders", {"id": 1})
    with capture_logs() as logs:
        app.run(until_idle=True)
    assert attempts == [1, 2, 3]
    assert [(e["due_in"], e["pending"]) for e in logs if e["event"] == "waiting_for_redelivery"] == [
        (60.0, 1), (120.0, 1)]
