"""Redelivery policies (ActiveMQ, RocketMQ), classification and the in-process retry."""

from __future__ import annotations

import random

import pytest

from backends.clock import FakeClock
from backends.errors import BodyDecodeError, ConfigurationError
from reliable.errors import TokenMissingError
from reliable.retry import (
    ROCKETMQ_DELAY_LEVELS,
    DelayLevels,
    InProcessRetry,
    RedeliveryPolicy,
    Verdict,
    build_classifier,
    call_with_retry,
    classify,
    fatal_on,
    parse_duration,
    retry_on,
    when,
)


def activemq_reference(initial, multiplier, cap, jitter, seed, count):
    """ActiveMQ's getNextRedeliveryDelay, written out step by step, the jittered delay fed back."""
    rng = random.Random(seed)
    delays, previous = [], 0.0
    for _ in range(count):
        if previous > 0 and multiplier > 1:
            nxt = previous * multiplier
            if cap != -1 and nxt > cap:
                nxt = max(cap, initial)
        else:
            nxt = initial
        if jitter > 0:
            positive = rng.random() < 0.5  # nextBoolean()
            size = rng.random()  # nextDouble()
            nxt += nxt * ((jitter if positive else -jitter) * size)
        delays.append(nxt)
        previous = nxt
    return delays


def policy_delays(policy, seed, count):
    rng, previous, delays = random.Random(seed), None, []
    for attempt in range(1, count + 1):
        previous = policy.next_delay(previous, rng, attempt=attempt)
        delays.append(previous)
    return delays


def test_jittered_delays_equal_activemq_reference():
    policy = RedeliveryPolicy(initial_delay=1.0, multiplier=5.0, max_delay=600.0, jitter=0.15)
    assert policy_delays(policy, 42, 8) == pytest.approx(activemq_reference(1.0, 5.0, 600.0, 0.15, 42, 8))


def test_delays_without_jitter_grow_then_cap():
    policy = RedeliveryPolicy(initial_delay=1.0, multiplier=5.0, max_delay=600.0)
    assert policy_delays(policy, 0, 6) == [1.0, 5.0, 25.0, 125.0, 600.0, 600.0]


def test_max_delay_below_initial_delay_keeps_initial_delay():
    policy = RedeliveryPolicy(initial_delay=10.0, multiplier=2.0, max_delay=3.0)
    assert policy_delays(policy, 0, 3) == [10.0, 10.0, 10.0]


def test_unlimited_max_delay_keeps_growing():
    policy = RedeliveryPolicy(initial_delay=1.0, multiplier=10.0, max_delay=-1)
    assert policy_delays(policy, 0, 5) == [1.0, 10.0, 100.0, 1000.0, 10000.0]


def test_no_exponential_backoff_is_constant():
    policy = RedeliveryPolicy(initial_delay=2.0, use_exponential_backoff=False)
    assert policy_delays(policy, 0, 3) == [2.0, 2.0, 2.0]


def test_jitter_stays_within_fraction():
    policy = RedeliveryPolicy(initial_delay=10.0, multiplier=1.0, jitter=0.5)
    delays = policy_delays(policy, 7, 200)
    assert all(5.0 <= d <= 15.0 for d in delays)
    assert min(delays) < 10.0 < max(delays)


def test_unknown_previous_delay_is_reconstructed_from_attempt():
    policy = RedeliveryPolicy(initial_delay=1.0, multiplier=5.0, max_delay=600.0)
    rng = random.Random(0)
    assert [policy.next_delay(None, rng, attempt=n) for n in (1, 2, 3, 6, 500)] == [1, 5, 25, 600, 600]


def test_gives_up_after_max_redeliveries():
    policy = RedeliveryPolicy(max_redeliveries=2)
    assert [policy.gives_up(a) for a in (1, 2, 3, 4)] == [False, False, True, True]
    assert RedeliveryPolicy(max_redeliveries=0).gives_up(1)
    assert not RedeliveryPolicy(max_redeliveries=-1).gives_up(10_000)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("initial_delay", -1.0, "seconds >= 0"),
        ("multiplier", 0.5, "a number >= 1"),
        ("max_delay", -2.0, "or -1 for no cap"),
        ("jitter", 1.0, "[0, 1)"),
        ("max_redeliveries", -2, "or -1 for no limit"),
    ],
)
def test_invalid_policy_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ConfigurationError) as info:
        RedeliveryPolicy(**{field: value})
    assert f"RedeliveryPolicy.{field} = {value!r}" in str(info.value)
    assert allowed in str(info.value)


def test_delay_levels_follow_rocketmq():
    levels = DelayLevels()
    rng = random.Random(0)
    assert levels.levels[:3] == (1.0, 5.0, 10.0)
    # redelivery n uses level 3 + n - 1: 10s, 30s, 1m, ...; the 16th reaches level 18 = 2h
    assert [levels.next_delay(None, rng, attempt=n) for n in (1, 2, 3, 16, 17)] == [10, 30, 60, 7200, 7200]
    assert not levels.gives_up(16) and levels.gives_up(17)


def test_delay_levels_custom_and_invalid():
    levels = DelayLevels(levels=("500ms", 2, "1m"), start_level=1, max_redeliveries=-1)
    assert [levels.next_delay(9.0, random.Random(), attempt=n) for n in (1, 2, 3, 4)] == [0.5, 2, 60, 60]
    assert not levels.gives_up(1000)
    with pytest.raises(ConfigurationError, match=r"DelayLevels.levels\[1\] = '5x' is not allowed"):
        DelayLevels(levels=("1s", "5x"))
    with pytest.raises(ConfigurationError, match="start_level = 4 .* from 1 to 3"):
        DelayLevels(levels=("1s", "2s", "3s"), start_level=4)
    assert len(ROCKETMQ_DELAY_LEVELS) == 18


def test_parse_duration():
    assert [parse_duration(v) for v in ("1s", "5m", "2h", "1d", "250ms", "1.5", 3)] == [
        1, 300, 7200, 86400, 0.25, 1.5, 3
    ]
    for bad in ("5x", "", "-1s", "s", True):
        with pytest.raises(ConfigurationError, match="is not a duration"):
            parse_duration(bad)


class Transient(Exception):
    pass


class Broken(Exception):
    pass


def test_classify_defaults():
    assert classify(Transient()) is Verdict.RETRY
    assert classify(BodyDecodeError("x")) is Verdict.FATAL
    assert classify(TokenMissingError("x")) is Verdict.FATAL
    # poison detected by reliable stays fatal whatever the classifier says
    assert classify(BodyDecodeError("x"), retry_on(Exception)) is Verdict.FATAL


def test_rules_compose_first_opinion_wins():
    rule = fatal_on(Broken) | retry_on(Exception) | (lambda exc: Verdict.FATAL)
    assert classify(Broken(), rule) is Verdict.FATAL
    assert classify(Transient(), rule) is Verdict.RETRY
    plain = (lambda exc: None) | when(lambda exc: "timeout" in str(exc), Verdict.RETRY) | fatal_on(Exception)
    assert classify(Transient("timeout"), plain) is Verdict.RETRY
    assert classify(Transient("refused"), plain) is Verdict.FATAL


def test_build_classifier_options():
    assert classify(Broken(), build_classifier(fatal=(Broken,))) is Verdict.FATAL
    assert classify(Transient(), build_classifier(fatal=(Broken,))) is Verdict.RETRY
    only = build_classifier(retry_on=(Transient,))
    assert classify(Transient(), only) is Verdict.RETRY
    assert classify(Broken(), only) is Verdict.FATAL  # retry_on given: the others are fatal
    predicate = build_classifier(fatal=(Broken,), predicate=lambda exc: "again" in str(exc))
    assert classify(Transient("again"), predicate) is Verdict.RETRY
    assert classify(Transient("never"), predicate) is Verdict.FATAL
    assert classify(Broken("again"), predicate) is Verdict.FATAL
    with pytest.raises(ConfigurationError, match="fatal: 'oops' is not allowed"):
        build_classifier(fatal=("oops",))  # type: ignore[arg-type]


def test_when_checks_its_arguments():
    with pytest.raises(ConfigurationError, match="expected a callable and a Verdict"):
        when(lambda exc: True, "retry")  # type: ignore[arg-type]


def test_classifier_returning_garbage_is_reported():
    with pytest.raises(ConfigurationError, match="expected a Verdict") as info:
        classify(Transient(), lambda exc: True)  # type: ignore[arg-type,return-value]
    assert isinstance(info.value.__cause__, Transient)


def flaky(failures, exc_type=Transient):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise exc_type(f"failure {len(calls)}")
        return "ok"

    return fn, calls


def test_in_process_retry_recovers_with_backoff():
    clock, retried = FakeClock(), []
    fn, calls = flaky(2)
    policy = InProcessRetry(attempts=3, initial_wait=0.05, max_wait=1.0, multiplier=2.0)
    result = call_with_retry(fn, policy=policy, classifier=None, clock=clock,
                             on_retry=lambda exc, attempt: retried.append((str(exc), attempt)))
    assert result == "ok"
    assert len(calls) == 3
    assert clock.sleeps == pytest.approx([0.05, 0.1])
    assert retried == [("failure 1", 1), ("failure 2", 2)]


def test_in_process_retry_caps_wait_and_reraises_original():
    clock = FakeClock()
    fn, calls = flaky(10)
    with pytest.raises(Transient, match="failure 4"):
        call_with_retry(fn, policy=InProcessRetry(attempts=4, initial_wait=0.5, max_wait=1.0),
                        clock=clock)
    assert len(calls) == 4
    assert clock.sleeps == pytest.approx([0.5, 1.0, 1.0])


def test_fatal_is_not_retried():
    clock = FakeClock()
    fn, calls = flaky(1, Broken)
    with pytest.raises(Broken):
        call_with_retry(fn, policy=InProcessRetry(), classifier=fatal_on(Broken), clock=clock)
    assert len(calls) == 1 and clock.sleeps == []


def test_base_exception_is_not_retried():
    clock = FakeClock()
    fn, calls = flaky(1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        call_with_retry(fn, policy=InProcessRetry(), clock=clock)
    assert len(calls) == 1


def test_invalid_in_process_retry():
    with pytest.raises(ConfigurationError, match=r"InProcessRetry.attempts = 0 is not allowed"):
        InProcessRetry(attempts=0)


def test_call_with_redelivery_waits_the_policy_s_delays_then_reports_the_spent_attempts():
    from reliable.retry import RetriesSpent, call_with_redelivery
    from reliable.testing import FakeClock

    clock = FakeClock()
    calls: list[tuple[int, float]] = []

    def always_failing(attempt: int) -> None:
        calls.append((attempt, clock.time()))
        raise ConnectionError("down")

    policy = RedeliveryPolicy(initial_delay=1.0, multiplier=2.0, max_delay=60, jitter=0.0, max_redeliveries=3)
    with pytest.raises(RetriesSpent) as spent:
        call_with_redelivery(always_failing, policy=policy, classifier=None, clock=clock, rng=random.Random(1))
    assert spent.value.attempts == 4 and isinstance(spent.value.error, ConnectionError)
    started = calls[0][1]
    assert [(n, t - started) for n, t in calls] == [(1, 0.0), (2, 1.0), (3, 3.0), (4, 7.0)]

    with pytest.raises(RetriesSpent) as fatal:  # fatal: no wait, no second call
        call_with_redelivery(lambda n: int("x"), policy=policy, classifier=fatal_on(ValueError),
                             clock=clock, rng=random.Random(1))
    assert fatal.value.attempts == 1
    with pytest.raises(KeyError):  # passed through unchanged
        call_with_redelivery(lambda n: {}["k"], policy=policy, classifier=None, clock=clock,
                             rng=random.Random(1), propagate=(KeyError,))


def test_policies_are_tenacity_waits_and_stops_that_compose():
    from tenacity import Retrying, wait_fixed

    clock, calls = FakeClock(), []

    def failing():
        calls.append(1)
        raise Transient("down")

    policy = RedeliveryPolicy(initial_delay=1.0, multiplier=2.0, max_delay=60, max_redeliveries=3)
    with pytest.raises(Transient):
        Retrying(wait=policy + wait_fixed(0.5), stop=policy.spent, sleep=clock.sleep, reraise=True)(failing)
    assert len(calls) == 4 and clock.sleeps == [1.5, 2.5, 4.5]

    levels = DelayLevels(levels=("1s", "5s"), start_level=1, max_redeliveries=-1)
    from tenacity import stop_after_attempt

    clock, calls[:] = FakeClock(), []
    with pytest.raises(Transient):
        Retrying(wait=levels, stop=levels.spent | stop_after_attempt(4), sleep=clock.sleep, reraise=True)(failing)
    assert clock.sleeps == [1.0, 5.0, 5.0]


def test_the_same_plan_retries_a_coroutine_without_blocking_the_loop():
    import asyncio

    from backends.clock import pause
    from reliable.retry import call_with_retry_async

    clock, calls, retried = FakeClock(), [], []

    async def flaky_coroutine():
        calls.append(1)
        if len(calls) < 3:
            raise Transient(f"failure {len(calls)}")
        return "ok"

    policy = InProcessRetry(attempts=3, initial_wait=0.05, max_wait=1.0, multiplier=2.0)
    result = asyncio.run(call_with_retry_async(flaky_coroutine, policy=policy, sleep=lambda s: pause(clock, s),
                                               on_retry=lambda exc, attempt: retried.append(attempt)))
    assert result == "ok" and clock.sleeps == pytest.approx([0.05, 0.1]) and retried == [1, 2]


def test_backoff_grows_from_the_failures_in_a_row_and_starts_again_after_a_success():
    from reliable.retry import Backoff

    clock = FakeClock()
    backoff = Backoff(clock)
    announced = []
    for _ in range(8):
        backoff.failed(lambda failures, delay: announced.append((failures, delay)))
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert announced[0] == (1, pytest.approx(0.1)) and backoff.succeeded() == 8
    backoff.failed()
    assert clock.sleeps[-1] == pytest.approx(0.1)


def test_a_stop_cuts_a_backoff_wait_short() -> None:
    """A worker waiting out a transport outage (up to 5 s a wait, twice in a row with
    ``--until-idle``) sat it out after Ctrl-C or SIGTERM: `reliable run` on a Redis URL nobody
    listens on stopped 10 s after the signal. The wait now ends when the stop is asked."""
    import threading

    from tenacity import wait_fixed

    from backends.clock import SYSTEM_CLOCK
    from reliable.retry import Backoff

    stopping, waiting = threading.Event(), threading.Event()
    backoff = Backoff(SYSTEM_CLOCK, wait_fixed(3600))
    waiter = threading.Thread(target=backoff.failed, args=(lambda failures, delay: waiting.set(), stopping))
    waiter.start()
    assert waiting.wait(60)
    stopping.set()
    waiter.join(60)  # an hour's wait, ended by the stop
    assert not waiter.is_alive()

    clock = FakeClock()  # a fake clock does not advance through a wait once stopping
    Backoff(clock).failed(stopping=stopping)
    assert clock.sleeps == []


def test_call_with_retry_async_awaits_every_attempt_of_a_plain_callable() -> None:
    """``fn`` may be any callable returning an awaitable (a lambda): each retry is awaited,
    not handed back unawaited (tenacity only awaits coroutine functions itself)."""
    import asyncio

    from reliable.retry import call_with_retry_async

    calls: list[int] = []
    waits: list[float] = []

    async def work() -> str:
        calls.append(len(calls) + 1)
        if len(calls) < 3:
            raise ConnectionError("transient")
        return "done"

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    result = asyncio.run(call_with_retry_async(lambda: work(), policy=InProcessRetry(attempts=4, initial_wait=0.5),
                                               sleep=sleep))
    assert result == "done" and calls == [1, 2, 3] and len(waits) == 2
