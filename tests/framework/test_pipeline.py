"""The handler pipeline on the in-memory transport, a real SQLite store and a fake clock."""

from __future__ import annotations

import itertools
import json
import random

import pytest

import reliable
from reliable import App, Message, Outcome
from reliable.errors import HandlerOptionError, TokenMissingError
from reliable.testing import dead_letter_queue

from .conftest import effects, pending, write_effect


class Transient(Exception):
    pass


def test_duplicates_are_acked_counted_and_never_rerun(app: App) -> None:
    calls: list[str] = []

    @app.handler("payments", group="billing", token="body.id")
    def charge(msg: Message, tx) -> None:
        calls.append(msg.body["id"])
        write_effect(tx, msg.body["id"])

    for i in ["a", "b", "a", "c", "b", "a"]:
        app.publish("payments", {"id": i})
    app.run(until_idle=True)

    assert sorted(calls) == ["a", "b", "c"]
    assert effects(app) == ["a", "b", "c"]
    stats = app.stats()
    assert stats["processed"] == 3 and stats["duplicate"] == 3
    assert pending(app, "billing", "payments") == 0


def test_failing_twice_then_succeeding_leaves_no_dead_letter(app: App) -> None:
    attempts: list[int] = []

    @app.handler("jobs", token="body.id", in_process=1,
                 retry=reliable.RedeliveryPolicy(initial_delay=1, multiplier=2, max_redeliveries=5))
    def job(msg: Message, tx) -> None:
        attempts.append(msg.attempt)
        if msg.attempt < 3:
            raise Transient("not yet")
        write_effect(tx, msg.body["id"], msg.attempt)

    app.publish("jobs", {"id": "j1"})
    app.run(until_idle=True)

    assert attempts == [1, 2, 3]
    assert effects(app) == ["j1"]
    assert app.dead_letters("job") == []
    assert app.stats()["redelivered"] == 2


def test_in_process_retry_absorbs_transient_failures(app: App, clock) -> None:
    calls = 0

    @app.handler("jobs", token="body.id", in_process=reliable.InProcessRetry(attempts=3, initial_wait=0.1))
    def job(msg: Message, tx) -> None:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise Transient("blip")
        write_effect(tx, msg.body["id"])

    app.publish("jobs", {"id": "j1"})
    app.run(until_idle=True)

    assert calls == 3 and effects(app) == ["j1"]
    assert app.stats()["retried"] == 2 and app.stats().get("redelivered", 0) == 0
    assert clock.sleeps[:2] == [0.1, 0.2]


def test_fatal_error_leaves_one_dead_letter_after_one_attempt(app: App) -> None:
    calls = 0

    @app.handler("payments", group="billing", token="body.id", fatal=(ValueError,))
    def charge(msg: Message, tx) -> None:
        nonlocal calls
        calls += 1
        write_effect(tx, msg.body["id"])
        raise ValueError("amount must be positive")

    app.publish("payments", {"id": "p-3", "amount": -5}, key="k1")
    app.run(until_idle=True)

    assert calls == 1
    assert effects(app) == []  # the handler's write rolled back with the failure
    [letter] = app.dead_letters("billing")
    assert letter.failure.attempts == 1
    assert letter.failure.error_type == "builtins.ValueError"
    assert letter.failure.error_message == "amount must be positive"
    assert "raise ValueError" in letter.failure.traceback
    assert letter.token == "p-3" and letter.message.key == "k1"
    assert letter.message.payload == b'{"id":"p-3","amount":-5}'
    assert [m.id for m in dead_letter_queue(app, "billing")] == [letter.message.id]


def test_redelivery_delays_follow_activemq(app: App, clock) -> None:
    policy = reliable.RedeliveryPolicy(initial_delay=1.0, multiplier=5.0, max_delay=600, jitter=0.15,
                                       max_redeliveries=6)
    app.runtime.rng.seed(42)
    seen_at: list[float] = []

    @app.handler("jobs", token="body.id", retry=policy, in_process=1)
    def job(msg: Message, tx) -> None:
        seen_at.append(clock.time())
        raise Transient("down")

    app.publish("jobs", {"id": "x"})
    app.run(until_idle=True)

    # ActiveMQ: first = initial; next = previous * multiplier, capped at max(max_delay, initial);
    # then ± jitter: variance = (±jitter) * nextDouble, delay += delay * variance. The transport
    # counts deliveries but does not carry the jittered delay, so "previous" is the un-jittered one.
    rng, previous, expected = random.Random(42), 0.0, []
    for _ in range(6):
        delay = 1.0 if previous == 0 else previous * 5.0
        delay = max(600.0, 1.0) if delay > 600 else delay
        previous = delay
        sign = 0.15 if rng.random() < 0.5 else -0.15
        delay += delay * (sign * rng.random())
        expected.append(delay)
    observed = [b - a for a, b in itertools.pairwise(seen_at)]
    assert len(seen_at) == 7  # first delivery + 6 redeliveries
    assert observed == pytest.approx(expected, abs=1e-3)
    [letter] = app.dead_letters("job")
    assert letter.failure.attempts == 7
    assert letter.failure.first_failure_at == seen_at[0]
    assert letter.failure.last_failure_at == seen_at[-1]


def test_delay_levels_as_alternative(app: App, clock) -> None:
    seen_at: list[float] = []

    @app.handler("jobs", token="body.id", in_process=1,
                 retry=reliable.DelayLevels(levels=("1s", "5s", "10s", "30s"), start_level=1, max_redeliveries=3))
    def job(msg: Message, tx) -> None:
        seen_at.append(clock.time())
        raise Transient("down")

    app.publish("jobs", {"id": "x"})
    app.run(until_idle=True)
    assert [round(b - a, 3) for a, b in itertools.pairwise(seen_at)] == [1.0, 5.0, 10.0]


def test_missing_token_and_undecodable_body_are_poison(app: App) -> None:
    @app.handler("orders", token="body.order_id")
    def handle(msg: Message, tx) -> None:
        write_effect(tx, str(msg.body["order_id"]))

    app.publish("orders", {"no": "token"})
    app.publish("orders", b"\xff{not json")
    app.run(until_idle=True)

    letters = app.dead_letters("handle")
    assert sorted(letter.failure.error_type.rsplit(".", 1)[-1] for letter in letters) == [
        "BodyDecodeError", "TokenMissingError"]
    assert {letter.failure.attempts for letter in letters} == {1}
    assert any(letter.message.payload == b"\xff{not json" for letter in letters)
    assert any("body.order_id" in letter.failure.error_message for letter in letters)


def test_a_misspelt_body_path_names_the_fields_the_body_has(app: App) -> None:
    """Every message of a misspelt path is dead-lettered: its record says which field was meant
    (it said only "has no token at body.paymentid")."""
    @app.handler("payments", token="body.paymentid")
    def charge(msg: Message) -> None:
        pass

    app.publish("payments", {"payment_id": "p-1", "amount": 10})
    app.publish("payments", {"paymentid": None})
    app.run(until_idle=True)

    messages = [letter.failure.error_message for letter in app.dead_letters("charge")]
    assert [m.split(": ", 1)[1] for m in messages] == [
        "the body has no field 'paymentid' (it has 'amount', 'payment_id'); did you mean 'payment_id'?",
        "the body's field 'paymentid' is None",
    ]


@pytest.mark.parametrize(("path", "body", "said"), [
    ("body.order.id", {"order": {"ID": 1}}, "body.order has no field 'id' (it has 'ID'); did you mean 'ID'?"),
    ("body.order.id", {"order": 3}, "body.order is int, not an object with a field 'id'"),
    ("body.items.2", {"items": [1]}, "body.items is a list of 1, with no item '2'"),
    ("body.id", ["a"], "the body is a list of 1, with no item 'id'"),
    ("body.id", {f"f{n:02}": n for n in range(25)}, "the body has no field 'id' (it has 'f00', 'f01', "
     "'f02', 'f03', 'f04', 'f05', 'f06', 'f07', 'f08', 'f09', 'f10', 'f11', 'f12', 'f13', 'f14', 'f15', "
     "'f16', 'f17', 'f18', 'f19', ...)"),
])
def test_a_missing_token_says_where_its_path_stopped(path: str, body: object, said: str) -> None:
    with pytest.raises(TokenMissingError) as raised:
        reliable.Token.parse(path)(Message(id="m-1", topic="t", queue=0, offset=0, payload=json.dumps(body).encode()))
    assert str(raised.value) == f"message m-1 has no token at {path}: {said}"


def test_replay_dead_letters_with_loop_guard(app: App) -> None:
    broken = True

    @app.handler("orders", token="body.id", fatal=(ValueError,))
    def handle(msg: Message, tx) -> None:
        if broken:
            raise ValueError("schema mismatch")
        write_effect(tx, msg.body["id"])

    app.publish("orders", {"id": "o1"})
    app.run(until_idle=True)
    assert len(app.dead_letters("handle")) == 1

    for expected_replays in (1, 2):
        assert app.replay_dead_letters("handle", max_replays=2) == 1
        app.run(until_idle=True)
        [letter] = app.dead_letters("handle")
        assert letter.replays == expected_replays
    with pytest.raises(reliable.ReplayLoopError):
        app.replay_dead_letters("handle", max_replays=2)

    broken = False
    assert app.replay_dead_letters("handle", max_replays=2, force=True) == 1
    app.run(until_idle=True)
    assert app.dead_letters("handle") == [] and effects(app) == ["o1"]


def test_batch_mode_isolates_a_poison_message(app: App) -> None:
    batches: list[int] = []

    @app.handler("orders", token="body.id", batch=50, fatal=(ValueError,))
    def handle(msgs: list[Message], tx) -> None:
        batches.append(len(msgs))
        for m in msgs:
            if m.body["id"] == "bad":
                raise ValueError("bad order")
            write_effect(tx, m.body["id"])

    app.publish_many("orders", [{"id": f"o{i:02}"} for i in range(10)] + [{"id": "bad"}, {"id": "o03"}])
    app.run(until_idle=True)

    assert effects(app) == [f"o{i:02}" for i in range(10)]
    assert [letter.token for letter in app.dead_letters("handle")] == ["bad"]
    assert batches[0] == 11  # one call for the batch (the in-batch duplicate removed)
    assert app.stats()["duplicate"] == 1


def test_batch_mode_uses_one_cache_round_trip_and_skips_known_tokens(app: App) -> None:
    @app.handler("orders", token="body.id", batch=100)
    def handle(msgs: list[Message], tx) -> None:
        for m in msgs:
            write_effect(tx, m.body["id"])

    app.publish_many("orders", [{"id": f"o{i}"} for i in range(20)])
    app.run(until_idle=True)
    cache = app.cache
    calls = {"seen": 0}
    original = cache.seen

    def counting_seen(namespace, tokens):
        calls["seen"] += 1
        return original(namespace, tokens)

    cache.seen = counting_seen
    app.publish_many("orders", [{"id": f"o{i}"} for i in range(10, 30)])
    app.run(until_idle=True)

    assert calls["seen"] == 1
    assert len(effects(app)) == 30
    assert app.stats()["duplicate"] == 10


def test_lease_mode_returns_the_stored_result_to_duplicates(app: App, clock) -> None:
    sent: list[str] = []

    @app.handler("emails", token="body.id", lease=30.0)
    def send(msg: Message) -> dict:
        sent.append(msg.body["id"])
        return {"provider_id": f"pm-{msg.body['id']}"}

    app.publish("emails", {"id": "e1"})
    app.publish("emails", {"id": "e1"})
    app.run(until_idle=True)
    assert sent == ["e1"]

    held = app.store.lease("send", "e1", 30.0)
    assert not held.acquired and held.result == {"provider_id": "pm-e1"}
    assert app.stats()["duplicate"] == 1


def test_lease_of_a_crashed_holder_is_reclaimed_after_expiry(app: App, clock) -> None:
    sent: list[str] = []

    @app.handler("emails", token="body.id", lease=30.0)
    def send(msg: Message) -> str:
        sent.append(msg.body["id"])
        return "ok"

    assert app.store.lease("send", "e2", 30.0).acquired  # a worker that then died
    app.publish("emails", {"id": "e2"})
    app.run(until_idle=True)  # waits (on the fake clock) for the lease to expire
    assert sent == ["e2"]
    assert app.stats()["deferred"] >= 1


def test_handler_options_are_validated_at_decoration(app: App) -> None:
    with pytest.raises(HandlerOptionError, match="token='nope'"):
        app.handler("t", token="nope")(lambda m, tx: None)
    with pytest.raises(HandlerOptionError, match="batch=0"):
        app.handler("t", batch=0)(lambda m, tx: None)
    with pytest.raises(HandlerOptionError, match="commit='sometimes'"):
        app.handler("t", commit="sometimes")(lambda m, tx: None)
    with pytest.raises(HandlerOptionError, match="retry="):
        app.handler("t", retry=3)(lambda m, tx: None)


def test_outcomes_name_the_ack_types() -> None:
    assert {o.value for o in Outcome} == {"processed", "duplicate", "redelivered", "dead_lettered", "deferred"}
