"""The steps every mode shares: token, repeats, cache, the failure branch, dead letters, cache fill.

A step is a coroutine function over the chunk of `Work` the mode hands it
(`Step`): one message in single and lease mode, the whole batch in batch
mode. Steps wait only through the pipeline's `Runner`, so the same steps run
sync handlers inline and ``async def`` handlers on an event loop. A step decides a message by giving it a `Result`; later steps leave
decided messages alone, except the dead-letter step, which writes the record
of every message decided DEAD_LETTERED (no dead letter without its record).
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog
from sqlalchemy.exc import DBAPIError

from backends.errors import ReliableError, StoreUnavailableError, UnreadableMessageError
from backends.store.engine import is_disk_full
from backends.types import DeadLetter, Failure, Message
from reliable.commit import OffsetWatermark
from reliable.deferrals import Deferrals
from reliable.handler import Handler
from reliable.idempotency import Guard
from reliable.message import REPLAYS_HEADER
from reliable.middleware import Middlewares
from reliable.outcome import Outcome, Result
from reliable.pipeline.runner import Runner, awaited
from reliable.retry import Verdict, call_with_retry_async, classify
from reliable.runtime import Runtime

log = structlog.get_logger("reliable.pipeline")


@dataclass
class Work:
    """One message on its way through the pipeline: its token once found, its result once decided."""

    message: Message
    token: str | None = None
    result: Result | None = None

    def decide(self, outcome: Outcome, **details: Any) -> None:
        self.result = Result(self.message, outcome, self.token, **details)


Step = Callable[[list[Work]], Awaitable[None]]


def store_down(exc: BaseException) -> bool:
    """Whether ``exc`` means the store cannot be reached: wrapped by the store already, or a
    database error that lost its connection or met a full disk (the handler's own statements, a
    savepoint). Not every ``OperationalError``: SQLite's "no such table" is one, and no retry
    fixes it."""
    if isinstance(exc, StoreUnavailableError):
        return True
    return isinstance(exc, DBAPIError) and (exc.connection_invalidated or is_disk_full(exc))


def undecided(work: Sequence[Work]) -> list[Work]:
    return [w for w in work if w.result is None]


class Steps:
    """The shared steps of one handler's pipeline, bound to its runtime."""

    def __init__(self, handler: Handler, runtime: Runtime, offsets: OffsetWatermark | None,
                 middleware: Middlewares, runner: Runner) -> None:
        self.handler, self.runtime, self.offsets, self.middleware = handler, runtime, offsets, middleware
        self.runner = runner
        self.config = handler.config
        self.deferrals = Deferrals()
        self.guard = Guard(
            namespace=handler.group,
            cache=runtime.cache,
            cache_ttl=self.config.cache_ttl,
            token_ttl=self.config.token_ttl,
            on_cache_down=lambda: runtime.counters.incr("cache_degraded"),
        )

    # -- before the handler -------------------------------------------------------------

    async def tokens(self, work: list[Work]) -> None:
        """Find each message's token; a message without one (or with an undecodable body) fails.

        In lease mode a handler without a token spec uses the message id: the lease needs a key.
        """
        for w in undecided(work):
            if w.message.unreadable is not None:
                reason = f"message {w.message.id}: {w.message.unreadable}"
                w.result = self.failed(w.message, None, UnreadableMessageError(reason))
                continue
            try:
                found = None if self.handler.token is None else self.handler.token(w.message)
            except ReliableError as exc:
                w.result = self.failed(w.message, None, exc)
                continue
            w.token = found if found is not None or self.handler.lease is None else w.message.id

    async def repeats(self, work: list[Work]) -> None:
        """A token seen earlier in the same chunk is a duplicate of that message."""
        first: set[str] = set()
        for w in undecided(work):
            if w.token is not None and w.token in first:
                w.decide(Outcome.DUPLICATE)
            elif w.token is not None:
                first.add(w.token)

    async def cached(self, work: list[Work]) -> None:
        """One cache round trip: tokens the cache has seen are duplicates."""
        tokens = [w.token for w in undecided(work) if w.token is not None]
        seen = await self.runner.offload(lambda: self.guard.cached(tokens)) if tokens else set()
        for w in undecided(work):
            if w.token is not None and w.token in seen:
                w.decide(Outcome.DUPLICATE)

    # -- around the handler ---------------------------------------------------------------

    async def call(self, messages: list[Message], tx: Any, *, batch: bool = False) -> Any:
        """The handler itself (awaited when it is ``async def``), between the middleware's
        ``before_handler`` and ``after_handler`` (timed on the runtime's clock)."""
        self.middleware.emit("before_handler", self.handler, messages)
        started = self.runtime.clock.monotonic()
        error: BaseException | None = None
        try:
            if batch:
                assert tx is not None, "batch mode runs in a transaction"
                return await self.handler.run_batch(messages, tx)
            return await self.handler.run(messages[0], tx)
        except BaseException as exc:
            error = exc
            raise
        finally:
            seconds = self.runtime.clock.monotonic() - started
            self.middleware.emit("after_handler", self.handler, messages, seconds, error)

    async def retrying(self, messages: Sequence[Message], fn: Callable[[], Awaitable[Any]]) -> Any:
        """``await fn()`` for ``messages`` under the in-process retry policy (transient errors
        retried in place; the middleware's ``on_retry`` sees each retry)."""
        def retried(exc: BaseException, attempt: int) -> None:
            self.middleware.emit("on_retry", self.handler, messages, exc, attempt)

        return await call_with_retry_async(fn, policy=self.config.in_process, classifier=self.handler.classifier,
                                           sleep=self.runner.sleep, on_retry=retried)

    async def save_offsets(self, tx: Any, messages: Sequence[Message]) -> None:
        """Save, in ``tx``, where the queues stand once ``messages`` are done too."""
        if self.offsets is None or not messages:
            return
        positions = self.offsets.positions_if_done(messages)
        if positions:
            await awaited(tx.save_offsets(self.handler.group, positions))

    async def claim(self, tx: Any, tokens: Sequence[str]) -> set[str]:
        """Claim ``tokens`` in ``tx`` (`Guard.claim`); the ones not returned are duplicates."""
        if not tokens:
            return set()
        return await awaited(tx.claim(self.guard.namespace, tokens, self.guard.token_ttl))

    def offsets_saved(self, messages: Sequence[Message]) -> None:
        """The transaction that saved ``messages``' positions committed: they are done."""
        if self.offsets is not None:
            self.offsets.mark_done(messages)

    # -- the failure branch -------------------------------------------------------------

    def failed(self, message: Message, token: str | None, exc: BaseException) -> Result:
        """Classify: redeliver with the policy's next delay, or dead-letter (recorded later)."""
        policy = self.config.redelivery
        attempt = self.deferrals.attempt(message)  # deliveries that waited out an outage left out
        if classify(exc, self.handler.classifier) is Verdict.RETRY and not policy.gives_up(attempt):
            delay = policy.next_delay(None, self.runtime.rng, attempt=attempt)
            return Result(message, Outcome.REDELIVERED, token, delay=delay, error=exc)
        return Result(message, Outcome.DEAD_LETTERED, token, failure=self._failure(message, exc, attempt), error=exc)

    def _failure(self, message: Message, exc: BaseException, attempt: int, note: str = "") -> Failure:
        now = self.runtime.clock.time()
        return Failure(
            error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            error_message=f"{exc}{note}",
            traceback="".join(traceback.format_exception(exc)),
            attempts=attempt,
            first_failure_at=message.first_failure_at or now,
            last_failure_at=now,
        )

    async def not_redelivered(self, result: Result, refusal: Exception) -> Result:
        """A REDELIVERED ``result`` whose redelivery the transport refused for good (its retry
        copy, with the headers the copy adds, above the wire's limit): dead-lettered instead,
        its failure saying why, recorded as `dead_letters` records (DUPLICATE if the group has
        its record already, DEFERRED while the store is down)."""
        assert result.error is not None
        note = f" [not redelivered: the transport refused its retry copy: {refusal}]"
        failure = self._failure(result.message, result.error, self.deferrals.attempt(result.message), note)
        work = Work(result.message, result.token, replace(result, outcome=Outcome.DEAD_LETTERED, failure=failure))
        await self.dead_letters([work])
        assert work.result is not None
        return work.result

    def deferred(self, message: Message, token: str | None, exc: Exception) -> Result:
        """The store was down: no ack at all, the message comes back after the policy's first delay."""
        delay = self.config.redelivery.next_delay(None, self.runtime.rng, attempt=1)
        return Result(message, Outcome.DEFERRED, token, delay=delay, error=exc)

    async def dead_letters(self, work: list[Work]) -> None:
        """Record every DEAD_LETTERED message, with the offsets, in one transaction.

        A message the group has a record of already (a duplicate of a poison
        message, a redelivery after a crash before the ack) becomes a
        DUPLICATE; with the store down every one becomes DEFERRED: it is not
        handed to the transport's dead-letter queue without its record.
        """
        poisoned = [w for w in work if w.result is not None and w.result.outcome is Outcome.DEAD_LETTERED]
        if not poisoned:
            return
        try:
            async with self.runner.transaction() as tx:
                for w in poisoned:
                    assert w.result is not None
                    w.result = await self._record(tx, w.result)
                await self.save_offsets(tx, [w.message for w in poisoned])
        except StoreUnavailableError as exc:
            for w in poisoned:
                w.result = self.deferred(w.message, w.token, exc)
            return
        self.offsets_saved([w.message for w in poisoned])

    async def _record(self, tx: Any, result: Result) -> Result:
        assert result.failure is not None
        replays = int(result.message.headers.get(REPLAYS_HEADER, 0) or 0)
        letter = DeadLetter(self.handler.group, result.message, result.token, result.failure, replays=replays)
        if await awaited(tx.add_dead_letter(letter)) is None:
            return replace(result, outcome=Outcome.DUPLICATE)
        return result

    # -- after ----------------------------------------------------------------------------

    async def count_deferrals(self, work: list[Work]) -> None:
        """Count each DEFERRED message's deferral (`Deferrals`); forget those done."""
        for w in work:
            if w.result is not None and w.result.outcome is Outcome.DEFERRED:
                self.deferrals.deferred(w.message)
        self.deferrals.settled([w.message for w in work if w.result is not None and w.result.acked])

    async def remember(self, work: list[Work]) -> None:
        """Queue the tokens of acked messages for the cache (written behind). Not one whose twin
        in the chunk is not done (`repeats` acked the twin, which says nothing of the token: the
        other failed, and a cached token would skip its retry as a duplicate)."""
        open_ = {w.token for w in work if w.result and not w.result.acked}
        self.guard.remember([w.result.token for w in work
                             if w.result and w.result.acked and w.result.token and w.result.token not in open_])
