"""Riding through a transport outage when publishing: retried within a bound, then raised.

A cluster electing a leader (NATS JetStream, a Kafka partition, a RabbitMQ
quorum queue) refuses writes for seconds; a server restarting, longer. The
transports report both as `BackendUnavailableError`. ``App.publish`` retries
such a publish with a growing wait (0.1 s doubling to 2 s, through the
injected clock) until ``[transport] publish_timeout`` has passed since the
first attempt, then raises the outage error to the caller. Any other error
is raised at once: a refused message does not get better by waiting.

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


def through_outages(call: Callable[[], T], clock: Clock, bound: float, doing: str) -> T:
    """``call()``, retried while it raises `BackendUnavailableError` until ``bound`` seconds passed."""
    started = clock.monotonic()

    def spent(state: RetryCallState) -> bool:
        return clock.monotonic() - started >= bound

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        log.warning("publish_retried", doing=doing, attempt=state.attempt_number,
                    waited=round(clock.monotonic() - started, 3), error=str(error))

    retrying = Retrying(
        retry=retry_if_exception_type(BackendUnavailableError),
        stop=spent,
        wait=wait_exponential(multiplier=FIRST_WAIT, max=MAX_WAIT),
        sleep=clock.sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(call)
