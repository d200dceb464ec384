"""The lease step: for side effects outside the database, an in-progress record with an expiry.

The lease is taken in a committed transaction of its own, renewed while the
handler runs (`Heartbeat`: the store's record and the transport's lease, as
JetStream's in-progress and Kafka's heartbeat do), so a handler slower than
its lease is not repeated by a twin; then the result is stored and returned
to duplicates. A store outage after the side effect leaves the message
unacked (DEFERRED): the lease expires and a redelivery may run it again,
the at-least-once that lease mode promises for effects outside the database.
The handler's ``tx.publish`` calls are kept (`Deferred`, one per attempt, so an
attempt that raised publishes nothing) and written as outbox rows in the
transaction that stores its result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from backends.errors import StoreUnavailableError
from backends.store.base import TokenState
from backends.store.outbox_writer import Deferred
from backends.types import Message
from reliable.outbox import checked_publish
from reliable.outcome import Outcome
from reliable.pipeline.steps import Steps, Work, undecided

log = structlog.get_logger("reliable.pipeline")

InProgress = Callable[[Sequence[Message]], None]
"""Tells the transport a message is still being worked on (`Subscription.in_progress`)."""

RENEWALS_PER_LEASE = 3
"""The lease is renewed this many times per lease period while the handler runs."""


class Heartbeat:
    """Calls ``beat`` every ``interval`` seconds on a thread of its own while the block runs.

    Paced by elapsed wall time (``threading.Event.wait``) because the handler
    it keeps alive runs in wall time; the expiry each beat writes is taken
    from the store's injected clock. A failed beat is logged, never raised:
    the lease may lapse, and the stored-result logic handles a twin.
    """

    def __init__(self, beat: Callable[[], None], interval: float, name: str) -> None:
        self._beat, self._interval, self._name = beat, interval, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"reliable-heartbeat-{name}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        # a beat stuck on a dead connection is not waited for: a late renewal changes nothing,
        # since only an IN_PROGRESS record is renewed and ours is DONE or released by then
        self._thread.join(self._interval)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception as exc:
                log.warning("lease_renewal_failed", handler=self._name, error=str(exc))


class Leased:
    """Lease mode's run step: lease → handler (renewing) → stored result, or release on failure."""

    def __init__(self, steps: Steps, in_progress: InProgress | None = None) -> None:
        self.steps = steps
        self.in_progress = in_progress
        self.seconds = float(steps.handler.lease or 0)

    async def __call__(self, work: list[Work]) -> None:
        for w in undecided(work):
            assert w.token is not None  # lease mode always has a token (message id by default)
            await self._run(w, w.token)

    async def _run(self, w: Work, token: str) -> None:
        steps, group, store = self.steps, self.steps.handler.group, self.steps.runtime.store
        try:
            held = await steps.runner.offload(lambda: store.lease(group, token, self.seconds))
        except StoreUnavailableError as exc:
            w.result = steps.deferred(w.message, token, exc)
            return
        if not held.acquired and held.state is TokenState.DONE:
            w.decide(Outcome.DUPLICATE, value=held.result)
            return
        if not held.acquired:
            # its holder renews it at most a lease ahead of its own clock: a wall clock here that
            # stepped back (or lags) does not defer the twin longer than a lease
            wait = min(max((held.expires_at or 0) - steps.runtime.clock.time(), 0.0), self.seconds) + 0.001
            log.info("lease_held", handler=steps.handler.name, token=token, retry_in=wait)
            w.decide(Outcome.DEFERRED, delay=wait)
            return
        async def attempt() -> tuple[Any, Deferred]:
            # per attempt: a failed one publishes nothing
            publish = Deferred(checked_publish(steps.runtime.transport, steps.middleware.outbox_hook))
            try:
                return await steps.call([w.message], publish), publish
            except BaseException:
                publish.end()
                raise

        try:
            with Heartbeat(lambda: self._renew(w.message, token), self.seconds / RENEWALS_PER_LEASE,
                           steps.handler.name):
                value, publish = await steps.retrying([w.message], attempt)
        except Exception as exc:
            await steps.runner.offload(lambda: self._release(token))
            w.result = steps.failed(w.message, token, exc)
            return
        await self._complete(w, token, value, publish)

    def _renew(self, message: Message, token: str) -> None:
        if not self.steps.runtime.store.renew_lease(self.steps.handler.group, token, self.seconds):
            log.warning("lease_lost", handler=self.steps.handler.name, token=token)
        if self.in_progress is not None:
            self.in_progress([message])

    async def _complete(self, w: Work, token: str, value: Any, publish: Deferred) -> None:
        """Store the result with what the handler published; with the store down the message is
        not acked and its lease expires."""
        steps, store = self.steps, self.steps.runtime.store
        try:
            await steps.retrying([w.message], lambda: steps.runner.offload(lambda: store.complete_lease(
                steps.handler.group, token, value, steps.config.token_ttl, publish)))
        except StoreUnavailableError as exc:
            log.error("lease_result_not_stored", handler=steps.handler.name, token=token, error=str(exc))
            w.decide(Outcome.DEFERRED, delay=self.seconds, error=exc)
            return
        w.decide(Outcome.PROCESSED, value=value)

    def _release(self, token: str) -> None:
        """Drop our lease so a redelivery may take it; with the store down it simply expires."""
        try:
            self.steps.runtime.store.release_lease(self.steps.handler.group, token)
        except StoreUnavailableError as exc:
            log.warning("lease_not_released", handler=self.steps.handler.name, token=token, error=str(exc))
