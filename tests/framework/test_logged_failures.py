"""What a new user sees in the log: the traceback (file and line) of a retried or dead-lettered failure."""

from __future__ import annotations

from structlog.testing import capture_logs

from reliable import App, Message


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


def _walk(tb):  # type: ignore[no-untyped-def]
    import traceback

    return traceback.walk_tb(tb)
