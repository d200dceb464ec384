"""Riding through a transport outage when publishing: retried within a bound, then raised.

A cluster electing a leader (NATS JetStream, a Kafka partition, a RabbitMQ
quorum queue) refuses writes for seconds; a server restarting, longer. The
transports report both as `BackendUnavailableError`. ``App.publish`` retries
such a publish with a growing wait (0.1 s doubling to 2 s, through the
injected clock) until ``[transport] publish_timeout`` has passed since the
first attempt, then raises the outage error to the caller. Any other error
is raised at once: a refused message does not get better by waiting. Each try
is told what remains of the bound (`Transport.publish`'s ``timeout``), so the
last one does not run a whole request timeout past it; no wait sleeps past it.

A publish retried after the outage may have reached the engine the first
time (the answer was lost): ``App.publish`` names each message before its
first try (a ``message_id`` the caller gave, else a new one), so every try
sends the same ids; engines that keep ids drop the copy (JetStream's
``Nats-Msg-Id``, the broker), and every consumer skips it by its token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import structlog
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential

from backends.clock import Clock
from backends.errors import BackendUnavailableError

log = structlog.get_logger("reliable.outage")
T = TypeVar("T")

FIRST_WAIT = 0.1
MAX_WAIT = 2.0


def through_outages(call: Callable[[float], T], clock: Clock, bound: float, doing: str) -> T:
    """``call(timeout)``, retried while it raises `BackendUnavailableError` until ``bound``
    seconds passed; ``timeout`` is what remains of ``bound`` when the try starts (at least
    `FIRST_WAIT`), for the try's requests to wait at most. Each failed try is logged with its
    ``timeout`` (``publish_retried``, or ``publish_gave_up`` for the last)."""
    started = clock.monotonic()
    tries: list[float] = []

    def left() -> float:
        return bound - (clock.monotonic() - started)

    def attempt() -> T:
        tries.append(max(left(), FIRST_WAIT))
        return call(tries[-1])

    def spent(state: RetryCallState) -> bool:
        return left() <= 0

    def wait(state: RetryCallState) -> float:
        return min(wait_exponential(multiplier=FIRST_WAIT, max=MAX_WAIT)(state), max(left(), 0.0))

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        log.warning("publish_retried", doing=doing, attempt=state.attempt_number, timeout=round(tries[-1], 3),
                    waited=round(clock.monotonic() - started, 3), error=str(error))

    retrying = Retrying(retry=retry_if_exception_type(BackendUnavailableError), stop=spent, wait=wait,
                        sleep=clock.sleep, before_sleep=before_sleep, reraise=True)
    try:
        return retrying(attempt)
    except BackendUnavailableError as exc:
        log.error("publish_gave_up", doing=doing, attempts=len(tries), timeout=round(tries[-1], 3),
                  waited=round(clock.monotonic() - started, 3), bound=bound, error=str(exc))
        raise
