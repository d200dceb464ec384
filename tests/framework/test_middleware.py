"""Middleware: every hook, in order (after-hooks reversed), for sync and async handlers and batch
mode; retries and dead letters; publishes (`app.publish` and `tx.publish`); and a middleware that
raises loses no message and masks no error."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from structlog.testing import capture_logs

import reliable
from reliable import App, Middleware
from reliable.errors import MiddlewareError
from reliable.testing import test_app


class Transient(Exception):
    pass


class Recorder(Middleware):
    """Appends ``(name, hook, detail)`` to a shared journal for every hook it sees."""

    def __init__(self, name: str, journal: list[tuple[str, str, object]]) -> None:
        self.name, self.journal = name, journal

    def note(self, hook: str, detail: object = None) -> None:
        self.journal.append((self.name, hook, detail))

    def on_open(self, app):
        self.note("on_open")

    def before_message(self, handler, message):
        self.note("before_message", message.body["id"])

    def before_handler(self, handler, messages):
        self.note("before_handler", len(messages))

    def after_handler(self, handler, messages, seconds, error):
        self.note("after_handler", type(error).__name__ if error else None)

    def on_retry(self, handler, messages, error, attempt):
        self.note("on_retry", attempt)

    def on_dead_letter(self, handler, result):
        self.note("on_dead_letter", result.message.body["id"])

    def after_message(self, handler, message, result):
        self.note("after_message", (message.body["id"], result.outcome.value))

    def before_publish(self, publish):
        self.note("before_publish", (publish.topic, publish.outbox))
        publish.headers[f"x-{self.name}"] = "seen"

    def after_publish(self, publish, error):
        self.note("after_publish", publish.topic)


def hooks(journal, name: str = "outer") -> list[tuple[str, object]]:
    return [(hook, detail) for who, hook, detail in journal if who == name]


@pytest.fixture
def journal() -> list[tuple[str, str, object]]:
    return []


@pytest.fixture
def app(tmp_path, journal) -> App:
    app = test_app(tmp_path, settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "2"})
    app.add_middleware(Recorder("outer", journal))
    app.add_middleware(Recorder("inner", journal))
    with app.store.transaction() as tx:
        tx.execute(text("create table effects (id text)"))
    yield app
    app.close()


def test_before_hooks_run_in_order_and_after_hooks_in_reverse(app, journal) -> None:
    @app.handler("orders", token="body.id")
    def handle(msg, tx):
        tx.execute(text("insert into effects values (:i)"), {"i": msg.body["id"]})

    app.publish("orders", {"id": "o-1"})
    journal.clear()
    app.run(until_idle=True)

    assert [(who, hook) for who, hook, _ in journal] == [
        ("outer", "before_message"), ("inner", "before_message"),
        ("outer", "before_handler"), ("inner", "before_handler"),
        ("inner", "after_handler"), ("outer", "after_handler"),
        ("inner", "after_message"), ("outer", "after_message"),
    ]
    assert hooks(journal)[-1] == ("after_message", ("o-1", "processed"))


@pytest.mark.parametrize("shape", ["sync", "async", "batch"])
def test_every_hook_is_called(app, journal, shape) -> None:
    """Retry, dead letter, outcome and publish hooks, for each handler shape; a duplicate is
    seen by before/after_message without a handler call."""
    # fails once in process, then succeeds (batch mode: the batch fails, then its isolated retry)
    failures = {"o-retry": 2 if shape == "batch" else 1}

    def work(msg, tx):
        order = msg.body["id"]
        if order == "o-poison":
            raise ValueError("never valid")
        if failures.get(order, 0) > 0:
            failures[order] -= 1
            raise Transient("database hiccup")
        tx.publish("invoices", {"order": order})

    if shape == "sync":
        @app.handler("orders", token="body.id", fatal=(ValueError,), retry_on=(Transient,))
        def handle(msg, tx):
            work(msg, tx)
    elif shape == "async":
        @app.handler("orders", token="body.id", fatal=(ValueError,), retry_on=(Transient,))
        async def handle(msg, tx):
            work(msg, tx)
    else:
        @app.handler("orders", token="body.id", fatal=(ValueError,), retry_on=(Transient,), batch=10)
        def handle(messages, tx):
            for m in messages:
                work(m, tx)

    for order in ("o-ok", "o-retry", "o-poison", "o-ok"):
        app.publish("orders", {"id": order})
    journal.clear()
    app.run(until_idle=True, handlers=["handle"])

    seen = hooks(journal)
    outcomes = sorted(d for h, d in seen if h == "after_message")
    assert outcomes == [("o-ok", "duplicate"), ("o-ok", "processed"), ("o-poison", "dead_lettered"),
                        ("o-retry", "processed")]
    assert sorted(d for h, d in seen if h == "before_message") == ["o-ok", "o-ok", "o-poison", "o-retry"]
    assert ("on_retry", 1) in seen
    assert ("on_dead_letter", "o-poison") in seen
    assert ("after_handler", "ValueError") in seen  # the poison message's call, its error passed on
    assert ("after_handler", None) in seen
    # tx.publish goes through the publish hooks as an outbox row, with the header they added
    assert ("before_publish", ("invoices", True)) in seen
    assert app.stats()["processed"] == 2 and app.stats()["dead_lettered"] == 1
    assert app.stats()["retried"] >= 1  # the built-in Counts middleware


def test_publish_hooks_add_headers_the_consumer_receives(app, journal) -> None:
    received = []

    @app.handler("orders")
    def handle(msg):
        received.append(dict(msg.headers))

    journal.clear()
    app.publish_many("orders", [{"id": "a"}, {"id": "b"}], headers={"x-mine": "1"})
    app.run(until_idle=True)

    assert [(who, h) for who, h, _ in journal if "publish" in h] == [
        ("outer", "before_publish"), ("inner", "before_publish"),
        ("inner", "after_publish"), ("outer", "after_publish"),
    ]
    assert hooks(journal)[0] == ("before_publish", ("orders", False))
    assert all(h["x-outer"] == "seen" and h["x-inner"] == "seen" and h["x-mine"] == "1" for h in received)
    assert len(received) == 2


def test_a_dead_letter_replay_runs_the_publish_hooks(app, journal) -> None:
    """A replay is a publish: its hooks see ``replay`` and the letters' own headers, and a header
    they add reaches the replayed message, next to the headers it was first published with."""
    seen: list[tuple[bool, list[str]]] = []
    received = []

    class Replays(Middleware):
        def before_publish(self, publish):
            seen.append((publish.replay, [h.get("x-mine", "") for h in publish.rows]))
            publish.headers["x-mine"] = "replayed" if publish.replay else publish.headers.get("x-mine", "")

    app.add_middleware(Replays())
    broken = [True]

    @app.handler("orders", group="billing", fatal=(ValueError,))
    def handle(msg):
        if broken[0]:
            raise ValueError("no tariff")
        received.append(dict(msg.headers))

    app.publish("orders", {"id": "a"}, headers={"x-mine": "first"})
    app.run(until_idle=True)
    broken[0] = False
    journal.clear()
    assert app.replay_dead_letters("billing") == 1
    app.run(until_idle=True)

    assert seen == [(False, []), (True, ["first"])]
    assert ("outer", "before_publish") in [(who, h) for who, h, _ in journal]
    [headers] = received
    assert headers["x-mine"] == "replayed" and headers["x-outer"] == "seen"
    assert headers["x-reliable-replays"] == "1"


class Raising(Middleware):
    """Raises from every hook it has."""

    def before_message(self, handler, message):
        raise RuntimeError("before_message broke")

    def before_handler(self, handler, messages):
        raise RuntimeError("before_handler broke")

    def after_handler(self, handler, messages, seconds, error):
        raise RuntimeError("after_handler broke")

    def after_message(self, handler, message, result):
        raise RuntimeError("after_message broke")

    def before_publish(self, publish):
        publish.headers["x-half"] = "done"
        raise RuntimeError("before_publish broke")


def test_a_raising_middleware_loses_no_message_and_masks_no_error(tmp_path, journal) -> None:
    """Every hook of one middleware raises: messages are still processed once and acked, the
    handler's own error is what the dead letter records, the middleware after it still runs,
    and the failure is logged."""
    app = test_app(tmp_path, settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    app.add_middleware(Raising())
    app.add_middleware(Recorder("after-it", journal))
    ran = []

    @app.handler("orders", group="g", token="body.id", fatal=(ValueError,))
    def handle(msg):
        ran.append(msg.body["id"])
        if msg.body["id"] == "bad":
            raise ValueError("the user's own error")

    with capture_logs() as logs:
        for order in ("good", "bad"):
            app.publish("orders", {"id": order})
        app.run(until_idle=True)

    assert sorted(ran) == ["bad", "good"]
    assert app.stats()["processed"] == 1 and app.stats()["dead_lettered"] == 1
    (letter,) = app.dead_letters("g")
    assert letter.failure.error_type.endswith("ValueError")
    assert letter.failure.error_message == "the user's own error"
    assert letter.message.headers["x-half"] == "done"  # published, with what the hook did
    assert sorted(d for h, d in hooks(journal, "after-it") if h == "after_message") == [
        ("bad", "dead_lettered"), ("good", "processed")]
    failed = {e["hook"] for e in logs if e["event"] == "middleware_failed"}
    assert failed == {"before_message", "before_handler", "after_handler", "after_message", "before_publish"}
    app.close()


def test_only_middleware_is_accepted(tmp_path) -> None:
    with pytest.raises(MiddlewareError, match="not a reliable.Middleware"):
        App(middleware=[object()])  # type: ignore[list-item]
    app = test_app(tmp_path)
    with pytest.raises(MiddlewareError):
        app.add_middleware(print)  # type: ignore[arg-type]


def test_the_built_ins_are_middleware_registered_first(tmp_path, journal) -> None:
    mine = Recorder("mine", journal)
    app = App(middleware=[mine])
    names = [type(m).__name__ for m in app.middleware]
    assert names == ["Logs", "Counts", "Prometheus", "Recorder"]
    assert all(isinstance(m, reliable.Middleware) for m in app.middleware)


def test_a_redelivery_is_an_outcome_and_lease_mode_calls_the_hooks(app, journal) -> None:
    attempts = []

    @app.handler("orders", token="body.id", lease=30.0, retry_on=(Transient,))
    def handle(msg, tx):
        attempts.append(msg.attempt)
        if msg.attempt == 1:
            raise Transient("gateway down")
        tx.publish("invoices", {"order": msg.body["id"]})

    app.publish("orders", {"id": "o-1"})
    journal.clear()
    app.run(until_idle=True, handlers=["handle"])

    outcomes = [d for h, d in hooks(journal) if h == "after_message"]
    assert outcomes == [("o-1", "redelivered"), ("o-1", "processed")]
    assert [d for h, d in hooks(journal) if h == "on_retry"] == [1]  # in process, before the redelivery
    assert [d for h, d in hooks(journal) if h == "before_publish"] == [("invoices", True)]  # once


class Tally(Middleware):
    """Takes a fetch's outcomes at once; raises on the first call to show the others still run."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str | None]]] = []

    def after_message(self, handler, message, result):  # pragma: no cover - never called
        raise AssertionError("after_messages overrides it")

    def after_messages(self, handler, outcomes):
        self.calls.append([(m.body["id"], r.outcome.value if r else None) for m, r in outcomes])
        if len(self.calls) == 1:
            raise RuntimeError("first tally broke")


def test_after_messages_takes_a_fetch_at_once(app, journal) -> None:
    tally = Tally()
    app.add_middleware(tally)

    @app.handler("orders", token="body.id")
    def handle(msg):
        pass

    for order in ("o-1", "o-2", "o-1"):
        app.publish("orders", {"id": order})
    app.run(until_idle=True)

    assert sorted(o for call in tally.calls for o in call) == [
        ("o-1", "duplicate"), ("o-1", "processed"), ("o-2", "processed")]
    assert any(len(call) > 1 for call in tally.calls)  # one call for several messages
    assert sorted(d for h, d in hooks(journal) if h == "after_message") == [  # the others: one by one
        ("o-1", "duplicate"), ("o-1", "processed"), ("o-2", "processed")]
    assert app.stats()["processed"] == 2 and app.stats()["duplicate"] == 1


class Relays(Middleware):
    """Journals the relay's sends; its ``before_relay`` raises, which must not stop them."""

    def __init__(self, journal: list[tuple[str, str, object]]) -> None:
        self.journal = journal

    def before_publish(self, publish):
        self.journal.append(("relays", "before_publish", publish.topic))
        publish.headers["x-row"] = "stamped"

    def before_relay(self, publish):
        self.journal.append(("relays", "before_relay",
                             (publish.topic, publish.count, [dict(h)["x-row"] for h in publish.rows])))
        publish.headers["x-relay"] = "lost"  # not sent: the rows go out as they were written
        raise RuntimeError("before_relay broke")

    def after_relay(self, publish, error):
        self.journal.append(("relays", "after_relay", (publish.topic, error)))


def test_the_relay_send_has_its_own_hooks_and_sends_the_rows_unchanged(tmp_path, journal) -> None:
    """A relay's send calls ``before_relay`` / ``after_relay`` (with the rows' headers), not the
    publish hooks a second time: each ``tx.publish`` was one publish, already seen."""
    app = test_app(tmp_path)
    app.add_middleware(Relays(journal))
    seen = []

    @app.handler("invoices")
    def invoice(msg):
        seen.append(dict(msg.headers))

    with app.store.transaction() as tx:
        tx.publish("invoices", {"order": "o-1"})
        tx.publish("invoices", {"order": "o-2"})
    with capture_logs() as logs:
        app.run(until_idle=True)

    assert hooks(journal, "relays") == [
        ("before_publish", "invoices"), ("before_publish", "invoices"),
        ("before_relay", ("invoices", 2, ["stamped", "stamped"])), ("after_relay", ("invoices", None))]
    assert [h["x-row"] for h in seen] == ["stamped", "stamped"]
    assert not any("x-relay" in h for h in seen)
    assert [e["hook"] for e in logs if e["event"] == "middleware_failed"] == ["before_relay"]
