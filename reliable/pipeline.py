"""The per-message pipeline: token → cache → claim → handler → commit → cache fill.

Three flows share the same steps and the same failure branch:
* single: one transaction per message;
* batch: one cache round trip, one store query, one transaction with the
  whole batch in a savepoint; if it fails, each message runs again in its
  own savepoint so a poison message does not roll back its neighbours;
* lease: for side effects outside the database, an in-progress record with
  an expiry and the stored result returned to duplicates.
The failure branch classifies the error: redeliver with the policy's next
delay, or dead-letter. The worker turns each `Result` into an ack.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import structlog

from backends.errors import ReliableError, StoreUnavailableError
from backends.store.base import TokenState, Transaction
from backends.types import DeadLetter, Failure, Message
from reliable import metrics
from reliable.commit import OffsetWatermark
from reliable.handler import Handler
from reliable.idempotency import Guard
from reliable.message import REPLAYS_HEADER
from reliable.outcome import Outcome, Result
from reliable.retry import Verdict, call_with_retry, classify
from reliable.runtime import Runtime

log = structlog.get_logger("reliable.pipeline")


class Pipeline:
    """Runs one handler's messages through the pipeline against a runtime.

    With ``offsets`` (the transactional commit strategy on a transport whose
    consumer keeps offsets), every transaction also saves where its queues
    stand once its messages are done: the contiguous prefix of the watermark,
    never past a message still in flight.
    """

    def __init__(self, handler: Handler, runtime: Runtime, offsets: OffsetWatermark | None = None) -> None:
        self.handler = handler
        self.config = handler.config
        self.runtime = runtime
        self.offsets = offsets
        self.guard = Guard(
            namespace=handler.group,
            cache=runtime.cache,
            cache_ttl=self.config.cache_ttl,
            token_ttl=self.config.token_ttl,
            on_cache_down=lambda: runtime.counters.incr("cache_degraded"),
        )

    def process(self, messages: Sequence[Message]) -> list[Result]:
        """Run ``messages`` through the pipeline; one `Result` per message, in order."""
        if self.handler.lease is not None:
            results = [self._leased(m) for m in messages]
        elif self.handler.batch:
            results = self._batch(list(messages))
        else:
            results = [self._single(m) for m in messages]
        self._report(results)
        return results

    # -- single ---------------------------------------------------------------

    def _single(self, message: Message) -> Result:
        try:
            token = self._token(message)
        except ReliableError as exc:
            return self._dead_letter_now(self._failed(message, None, exc))
        if token is not None and self.guard.cached([token]):
            return Result(message, Outcome.DUPLICATE, token)
        try:
            claimed, value = self._retrying(lambda: self._transaction(message, token))
        except StoreUnavailableError as exc:
            return self._deferred(message, token, exc)
        except Exception as exc:
            return self._dead_letter_now(self._failed(message, token, exc))
        if token is not None:
            self.guard.remember([token])
        return Result(message, Outcome.PROCESSED if claimed else Outcome.DUPLICATE, token, value)

    def _transaction(self, message: Message, token: str | None) -> tuple[bool, Any]:
        with self.runtime.store.transaction() as tx:
            if token is not None and not self.guard.claim(tx, [token]):
                return False, None
            value = self.handler.call(message, tx)
            self._save_offsets(tx, [message])
        self._offsets_saved([message])
        return True, value

    # -- batch ----------------------------------------------------------------

    def _batch(self, messages: list[Message]) -> list[Result]:
        results: dict[int, Result] = {}
        candidates: list[tuple[int, Message, str | None]] = []
        first_of: dict[str, int] = {}
        for i, message in enumerate(messages):
            try:
                token = self._token(message)
            except ReliableError as exc:
                results[i] = self._failed(message, None, exc)
                continue
            if token is not None and token in first_of:
                results[i] = Result(message, Outcome.DUPLICATE, token)
                continue
            if token is not None:
                first_of[token] = i
            candidates.append((i, message, token))
        seen = self.guard.cached([t for _, _, t in candidates if t is not None])
        fresh = []
        for i, message, token in candidates:
            if token is not None and token in seen:
                results[i] = Result(message, Outcome.DUPLICATE, token)
            else:
                fresh.append((i, message, token))
        try:
            self._batch_transaction(fresh, results)
        except StoreUnavailableError as exc:
            for i, message, token in fresh:
                results[i] = self._deferred(message, token, exc)
            for i, result in list(results.items()):  # no dead letter without its record
                if result.outcome is Outcome.DEAD_LETTERED:
                    results[i] = self._deferred(result.message, result.token, exc)
        self.guard.remember([r.token for r in results.values() if r.acked and r.token])
        return [results[i] for i in range(len(messages))]

    def _batch_transaction(self, fresh: list[tuple[int, Message, str | None]], results: dict[int, Result]) -> None:
        with self.runtime.store.transaction() as tx:
            try:
                with tx.savepoint():
                    claimed = self.guard.claim(tx, [t for _, _, t in fresh if t is not None])
                    run = [(i, m, t) for i, m, t in fresh if t is None or t in claimed]
                    if run:
                        self.handler.call_batch([m for _, m, _ in run], tx)
                for i, message, token in fresh:
                    processed = token is None or token in claimed
                    results[i] = Result(message, Outcome.PROCESSED if processed else Outcome.DUPLICATE, token)
            except StoreUnavailableError:
                raise
            except Exception as exc:
                log.info("batch_isolating_failure", handler=self.handler.name, size=len(fresh), error=str(exc))
                for i, message, token in fresh:
                    results[i] = self._isolated(tx, message, token)
            for i, result in list(results.items()):
                if result.outcome is Outcome.DEAD_LETTERED:
                    results[i] = self._dead_letter_in(tx, result)
            done = [r.message for r in results.values() if r.acked or r.outcome is Outcome.DEAD_LETTERED]
            self._save_offsets(tx, done)
        self._offsets_saved(done)

    def _isolated(self, tx: Transaction, message: Message, token: str | None) -> Result:
        def attempt() -> bool:
            with tx.savepoint():
                if token is not None and not self.guard.claim(tx, [token]):
                    return False
                self.handler.call_batch([message], tx)
                return True

        try:
            processed = self._retrying(attempt)
        except StoreUnavailableError:
            raise
        except Exception as exc:
            return self._failed(message, token, exc)
        return Result(message, Outcome.PROCESSED if processed else Outcome.DUPLICATE, token)

    # -- lease ----------------------------------------------------------------

    def _leased(self, message: Message) -> Result:
        try:
            token = self._token(message) or message.id
        except ReliableError as exc:
            return self._dead_letter_now(self._failed(message, None, exc))
        store, lease = self.runtime.store, float(self.handler.lease or 0)
        try:
            held = store.lease(self.handler.group, token, lease)
        except StoreUnavailableError as exc:
            return self._deferred(message, token, exc)
        if not held.acquired and held.state is TokenState.DONE:
            return Result(message, Outcome.DUPLICATE, token, held.result)
        if not held.acquired:
            wait = max((held.expires_at or 0) - self.runtime.clock.time(), 0.0) + 0.001
            log.info("lease_held", handler=self.handler.name, token=token, retry_in=wait)
            return Result(message, Outcome.DEFERRED, token, delay=wait)
        try:
            value = self._retrying(lambda: self.handler.call(message, None))
        except Exception as exc:
            store.release_lease(self.handler.group, token)
            return self._dead_letter_now(self._failed(message, token, exc))
        store.complete_lease(self.handler.group, token, value, self.config.token_ttl)
        self.guard.remember([token])
        return Result(message, Outcome.PROCESSED, token, value)

    # -- shared steps ---------------------------------------------------------

    def _token(self, message: Message) -> str | None:
        return None if self.handler.token is None else self.handler.token(message)

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        def retried(exc: BaseException, attempt: int) -> None:
            self.runtime.counters.incr("retried")
            metrics.count(self.handler.name, "retried")
            log.info("retrying_in_process", handler=self.handler.name, attempt=attempt, error=repr(exc))

        return call_with_retry(
            fn,
            policy=self.config.in_process,
            classifier=self.handler.classifier,
            clock=self.runtime.clock,
            on_retry=retried,
        )

    def _save_offsets(self, tx: Transaction, messages: Sequence[Message]) -> None:
        if self.offsets is None or not messages:
            return
        positions = self.offsets.positions_if_done(messages)
        if positions:
            tx.save_offsets(self.handler.group, positions)

    def _offsets_saved(self, messages: Sequence[Message]) -> None:
        """The transaction that saved ``messages``' positions committed: they are done."""
        if self.offsets is not None:
            self.offsets.mark_done(messages)

    def _failed(self, message: Message, token: str | None, exc: BaseException) -> Result:
        """The failure branch: redeliver with the policy's next delay, or dead-letter."""
        now = self.runtime.clock.time()
        policy = self.config.redelivery
        if classify(exc, self.handler.classifier) is Verdict.RETRY and not policy.gives_up(message.attempt):
            delay = policy.next_delay(None, self.runtime.rng, attempt=message.attempt)
            return Result(message, Outcome.REDELIVERED, token, delay=delay, error=exc)
        failure = Failure(
            error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            error_message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            attempts=message.attempt,
            first_failure_at=message.first_failure_at or now,
            last_failure_at=now,
        )
        return Result(message, Outcome.DEAD_LETTERED, token, failure=failure, error=exc)

    def _dead_letter_in(self, tx: Transaction, result: Result) -> Result:
        """Record ``result``'s dead letter in ``tx``; a message the group already has a record
        of (a duplicate of a poison message, a redelivery after a crash before the ack) is a
        DUPLICATE instead: one record per message and replay."""
        assert result.failure is not None
        replays = int(result.message.headers.get(REPLAYS_HEADER, 0) or 0)
        letter = DeadLetter(self.handler.group, result.message, result.token, result.failure, replays=replays)
        if tx.add_dead_letter(letter) is None:
            return replace(result, outcome=Outcome.DUPLICATE)
        return result

    def _dead_letter_now(self, result: Result) -> Result:
        """Write the dead-letter record of a DEAD_LETTERED result in its own transaction."""
        if result.outcome is not Outcome.DEAD_LETTERED:
            return result
        try:
            with self.runtime.store.transaction() as tx:
                result = self._dead_letter_in(tx, result)
                self._save_offsets(tx, [result.message])
        except StoreUnavailableError as exc:
            return self._deferred(result.message, result.token, exc)
        self._offsets_saved([result.message])
        return result

    def _deferred(self, message: Message, token: str | None, exc: Exception) -> Result:
        delay = self.config.redelivery.next_delay(None, self.runtime.rng, attempt=1)
        return Result(message, Outcome.DEFERRED, token, delay=delay, error=exc)

    def _report(self, results: Sequence[Result]) -> None:
        """Count every outcome; log failures one by one and successes as one batch event."""
        tally = Counter(r.outcome for r in results)
        for outcome, count in tally.items():
            self.runtime.counters.incr(outcome.value, count)
            metrics.count(self.handler.name, outcome.value, count)
        for result in results:
            if result.outcome in _FAILURE_EVENTS:
                self._log_failure(result)
        log.debug("messages_handled", handler=self.handler.name, group=self.handler.group,
                  **{o.value: n for o, n in tally.items()})

    def _log_failure(self, result: Result) -> None:
        m = result.message
        level, event = _FAILURE_EVENTS[result.outcome]
        getattr(log, level)(
            event,
            handler=self.handler.name, group=self.handler.group, topic=m.topic, queue=m.queue,
            offset=m.offset, token=result.token, attempt=m.attempt, delay=round(result.delay, 3),
            error=repr(result.error),
        )


_FAILURE_EVENTS = {
    Outcome.REDELIVERED: ("warning", "redelivery_scheduled"),
    Outcome.DEAD_LETTERED: ("error", "dead_lettered"),
    Outcome.DEFERRED: ("warning", "message_deferred"),
}
