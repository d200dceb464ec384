"""The consume loop of one handler: subscribe, fetch with prefetch, dispatch, acknowledge.

A worker is one member of its handler's group. With ``concurrency > 1``
messages are dispatched to lanes by key, so messages with the same key keep
their order: a sync handler's lanes run on threads, an ``async def``
handler's as tasks on one event loop (`OnLoop`), ``concurrency`` messages in
flight. Where the consumer keeps offsets (`Capabilities.consumer_offsets`)
the worker tracks the contiguous prefix of done offsets (`OffsetWatermark`),
commits only that, and — with the transactional strategy — saves it in the
handler's transaction and seeks back to it when queues are assigned.

A transport that cannot be reached does not end the worker: the subscription
is dropped, the worker waits with a growing backoff (`reliable.retry.Backoff`) and
subscribes again. Messages it held are redelivered by the transport and
de-duplicated by their tokens. An ack or commit the server refused is met the
same way (the effects are committed with the token), logged with the message
ids; a nack or dead letter refused has its own way out (`Worker._hand_back`).
A transport whose disk is full (`DiskFullError`), or that refuses writes for
now (`WritesRefusedError`: a RabbitMQ resource alarm), is reachable: the worker keeps its membership and
waits the same backoff; a message it could not hand back comes back when its
lease expires (on RabbitMQ, the member sends its copy once the alarm clears).
A store that is down, or whose disk refuses writes, holds fetching
(`StoreGate`): each delivery of a message that can only be deferred would cost
it one of its redeliveries.
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from backends.errors import (
    BackendUnavailableError,
    DiskFullError,
    ReliableError,
    TransportError,
    WritesRefusedError,
)
from backends.transport.base import SubscribeOptions, Subscription
from backends.types import Message, QueueRef
from backends.watermark import GroupProgress
from reliable import metrics
from reliable.commit import CommitStrategy, OffsetWatermark
from reliable.deferrals import StoreGate
from reliable.handler import Handler
from reliable.middleware import Middlewares
from reliable.outcome import Outcome, Result
from reliable.pipeline import Pipeline
from reliable.pipeline.runner import OnLoop, drive
from reliable.pipeline.steps import store_down
from reliable.retry import Backoff
from reliable.runtime import Runtime

log = structlog.get_logger("reliable.worker")
FAILED = object()
"""What a guarded transport call returns when the transport could not be reached."""

LAG_INTERVAL = 5.0
"""Seconds between consumer-lag readings while messages flow (an idle poll always reads it)."""


class Worker:
    """Consumes one handler's topic as a member of its group."""

    def __init__(self, handler: Handler, runtime: Runtime, strategy: CommitStrategy,
                 stopping: threading.Event | None = None, middleware: Middlewares | None = None) -> None:
        self.handler = handler
        self.stopping = stopping or threading.Event()  # set: finish what is in flight, start nothing
        self.runtime = runtime
        self.strategy = strategy
        capabilities = runtime.transport.capabilities
        self.watermark = (OffsetWatermark(reads_in_order=capabilities.reads_in_order)
                          if capabilities.consumer_offsets else None)
        saves_offsets = strategy.in_transaction and self.watermark is not None
        if strategy.in_transaction and self.watermark is None:
            log.info("offsets_not_saved", handler=handler.name,
                     reason="the transport acknowledges each message; transactional acts as per_message")
        self.lanes = handler.config.concurrency
        self._loop = OnLoop(runtime.store, runtime.clock, self.lanes, handler.name) if handler.is_async else None
        self.pipeline = Pipeline(handler, runtime, self.watermark if saves_offsets else None, self._in_progress,
                                 self._loop, middleware)
        self._renewing = threading.Lock()
        self._saves_offsets = saves_offsets
        threads = self.lanes > 1 and self._loop is None
        self._pool = ThreadPoolExecutor(self.lanes, thread_name_prefix=f"reliable-{handler.name}") if threads else None
        self._subscription: Subscription | None = None
        self._reconnect = Backoff(runtime.clock)  # 0.1 s doubling to 5 s
        self.store_gate = StoreGate(runtime.store, runtime.clock, handler.name, self.stopping)
        self.in_hand = 0  # messages fetched and not yet settled (what a forced exit hands back)
        self._lag_read_at = float("-inf")  # when the consumer lag was last read (`LAG_INTERVAL`)
        self._saved: dict[QueueRef, int] = {}  # positions an idle poll saved (`_save_idle`)

    @property
    def fetch_size(self) -> int:
        return self.handler.batch * self.lanes if self.handler.batch else self.handler.config.prefetch

    @property
    def subscription(self) -> Subscription:
        """This worker's membership of its group (joined on first use, again after an outage)."""
        if self._subscription is None:
            options = SubscribeOptions(
                prefetch=max(self.handler.config.prefetch, self.fetch_size),
                on_assign=self._assigned,
                on_revoke=self._revoked,
            )
            self._subscription = self.runtime.transport.subscribe(self.handler.group, [self.handler.topic], options)
            log.info("group_joined", handler=self.handler.name, group=self.handler.group, topic=self.handler.topic)
        return self._subscription

    def poll(self, timeout: float) -> int:
        """One fetch-and-process cycle; returns how many messages were fetched."""
        if not self.store_gate.passes():
            return 0
        messages = self._guarded(lambda: self.subscription.fetch(self.fetch_size, timeout))
        if messages is FAILED:
            return 0
        if messages:
            if self.watermark is not None:
                self.watermark.fetched(messages)
                self._follow_group(self.watermark)
            self.in_hand = len(messages)
            try:
                self._settle(self._dispatch(messages))
            finally:
                self.in_hand = 0
        elif self.watermark is not None and self._saves_offsets and isinstance(self._subscription, GroupProgress):
            self._save_idle(self.watermark)  # a member sharing its queues finishes others' messages
        self.strategy.tick(self._ack, self.runtime.clock.monotonic())
        self._report_lag(idle=not messages)
        return len(messages)

    def _follow_group(self, watermark: OffsetWatermark) -> None:
        """Move the watermark over what the other members finished, where they share its queues
        (a leasing transport): its own done offsets stop at the first one another member took,
        so its position, saved and committed, stayed there for as long as the group ran."""
        subscription, held = self._subscription, watermark.held()
        if not held or not isinstance(subscription, GroupProgress):
            return
        finished = self._guarded(lambda: subscription.finished_below(held))
        if finished is not FAILED and (advanced := watermark.finished(finished)):
            self._settling("commit", [], lambda s: s.commit(advanced))

    def _save_idle(self, watermark: OffsetWatermark) -> None:
        """Save the positions once idle where they passed what transactions saved (duplicates, the
        group's finished offsets followed): a restart read those again. A refusal loses nothing."""
        self._follow_group(watermark)
        unsaved = {ref: at for ref, at in watermark.committable().items() if at > self._saved.get(ref, 0)}
        try:
            if unsaved:
                with self.runtime.store.transaction() as tx:
                    tx.save_offsets(self.handler.group, unsaved)
                self._saved.update(unsaved)
        except ReliableError as exc:
            log.warning("offsets_not_saved", handler=self.handler.name, error=str(exc))

    def _report_lag(self, idle: bool) -> None:
        """Set the consumer-lag gauge from the transport's count of what is left for the group."""
        now = self.runtime.clock.monotonic()
        if not self.runtime.transport.capabilities.drain or (not idle and now - self._lag_read_at < LAG_INTERVAL):
            return
        self._lag_read_at = now
        pending = self._guarded(lambda: self.subscription.pending())
        if pending is not FAILED:
            metrics.consumer_lag(self.handler.name, self.handler.topic, pending)

    def pending(self) -> int:
        """Messages left for the group; a transport that cannot tell counts as 0 (never idle-waits)."""
        if not self.runtime.transport.capabilities.drain:
            return 0
        pending = self._guarded(lambda: self.subscription.pending())
        return 1 if pending is FAILED else pending  # unreachable: not idle, try again

    def next_due(self) -> float | None:
        if not self.runtime.transport.capabilities.drain:
            return None
        due = self._guarded(lambda: self.subscription.next_due())
        return None if due is FAILED else due

    def transport_reachable(self) -> bool:
        """False while the worker waits out a transport outage (readiness, `reliable.health`)."""
        return self._reconnect.failures == 0

    def flush(self) -> None:
        self.strategy.flush(self._ack)
        self.pipeline.guard.flush()

    def close(self) -> None:
        self.flush()
        self.strategy.close()
        self.pipeline.guard.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._loop is not None:
            self._loop.close()
        self._leave()

    # -- assignment -------------------------------------------------------------------------

    def _assigned(self, queues: Sequence[QueueRef]) -> Mapping[QueueRef, int]:
        """Start ``queues`` afresh; with saved offsets, resume each from its saved position.

        A queue with no saved offset resumes from 0: the saved offsets are the
        whole truth of where the group stands, so the watermark must never start
        above a message a dead member fetched but did not finish.
        """
        if self.watermark is not None:
            self.watermark.forget(queues)
        if not self._saves_offsets or self.watermark is None:
            return {}
        saved = self.runtime.store.load_offsets(self.handler.group)
        resume = {ref: saved.get(ref, 0) for ref in queues}
        self.watermark.start(resume)
        if any(resume.values()):
            log.info("offsets_resumed", handler=self.handler.name, group=self.handler.group,
                     offsets={f"{r.topic}/{r.queue}": o for r, o in sorted(resume.items()) if o})
        return resume

    def _revoked(self, queues: Sequence[QueueRef]) -> None:
        """Acknowledge what is done before another member takes ``queues``.

        When the worker leaves (shutdown, outage) it has flushed already, or cannot.
        """
        try:
            if self._subscription is not None:
                self.strategy.flush(self._ack)
        finally:
            if self.watermark is not None:
                self.watermark.forget(queues)

    # -- dispatch and acknowledgement ---------------------------------------------------------

    def _dispatch(self, messages: list[Message]) -> list[Result]:
        if self._loop is not None:
            return self._loop.run(self._in_flight(self._lanes(messages)))
        if self._pool is None:
            return self._process(messages)
        futures = [self._pool.submit(self._process, lane) for lane in self._lanes(messages)]
        return [result for future in futures for result in future.result()]

    def _lanes(self, messages: list[Message]) -> list[list[Message]]:
        """``messages`` split over the lanes: by key (one key, one lane: its order is kept),
        messages without a key dealt out in turn (no order to keep; the lanes fill evenly)."""
        lanes: list[list[Message]] = [[] for _ in range(self.lanes)]
        keyless = 0
        for m in messages:
            if m.key is None:
                lanes[keyless % self.lanes].append(m)
                keyless += 1
            else:
                lanes[zlib.crc32(m.key.encode()) % self.lanes].append(m)
        return [lane for lane in lanes if lane]

    async def _in_flight(self, lanes: list[list[Message]]) -> list[Result]:
        """Every lane as a task on the loop; each runs its messages in order."""
        done = await asyncio.gather(*(self.pipeline.run(lane, self.stopping.is_set) for lane in lanes))
        return [result for results in done for result in results]

    def _process(self, messages: list[Message]) -> list[Result]:
        """Run the pipeline on ``messages``; once stopping, the rest stay unacknowledged and go
        back to the group when this member leaves."""
        return self.pipeline.process(messages, self.stopping.is_set)

    def _settle(self, results: Sequence[Result]) -> None:
        if any(r.outcome is Outcome.DEFERRED and r.error is not None and store_down(r.error) for r in results):
            self.store_gate.store_down()
        self._advance([r.message for r in results if self._hand_back(r)])
        self.strategy.done([r.message for r in results if r.acked], self._ack, self.runtime.clock.monotonic())

    def _hand_back(self, result: Result) -> bool:
        """Nack or dead-letter a message that was not done; True once the transport took it."""
        message, failure = result.message, result.failure
        if result.outcome is Outcome.REDELIVERED or result.outcome is Outcome.DEFERRED:
            try:
                return self._settling("nack", [message], lambda s: s.nack(message, result.delay)) is not FAILED
            except TransportError as exc:  # refused, not an outage: a retry copy above the wire's limit
                return self._not_redelivered(result, exc)
        if result.outcome is Outcome.DEAD_LETTERED and failure is not None:
            try:  # the transport's copy carries the failure cut short: every wire bounds headers
                return self._settling("dead_letter", [message],
                                      lambda s: s.dead_letter(message, failure.summary())) is not FAILED
            except TransportError as exc:  # refused, not an outage: the store's record is the letter
                log.error("dead_letter_copy_refused", handler=self.handler.name, topic=message.topic,
                          offset=message.offset, error=str(exc))
                return self._settling("ack", [message], lambda s: s.ack([message])) is not FAILED
        return False

    def _not_redelivered(self, result: Result, refusal: TransportError) -> bool:
        """The transport refused ``result``'s redelivery for good: a failed message is dead-lettered
        instead (recorded, then handed back as a dead letter), no longer ending the worker, which
        met the same refusal at every restart. A deferred one (the store down) cannot be recorded:
        it is left unacknowledged, to come back when the transport's lease on it ends."""
        message = result.message
        log.error("redelivery_refused", handler=self.handler.name, topic=message.topic, offset=message.offset,
                  attempt=message.attempt, error=str(refusal))
        if result.outcome is Outcome.DEFERRED:
            return False
        steps = self.pipeline.steps.not_redelivered(result, refusal)
        letter = self._loop.run(steps) if self._loop is not None else drive(steps)
        if letter.outcome is Outcome.DEFERRED:
            return False
        if letter.outcome is Outcome.DUPLICATE:
            return self._settling("ack", [message], lambda s: s.ack([message])) is not FAILED
        self.pipeline.middleware.emit("on_dead_letter", self.handler, letter)
        return self._hand_back(letter)

    def _in_progress(self, messages: Sequence[Message]) -> None:
        """Extend the transport's lease on ``messages`` (from a lease heartbeat; lanes take turns).

        Called while the worker's own thread waits for the pipeline, so it never
        races the worker's acks; an outage is left to the heartbeat to log.
        """
        with self._renewing:
            subscription = self._subscription
            if subscription is not None:
                subscription.in_progress(messages)

    def _ack(self, messages: Sequence[Message]) -> None:
        if self._settling("ack", messages, lambda s: s.ack(messages)) is not FAILED:
            self._advance(messages)

    def _advance(self, messages: Sequence[Message]) -> None:
        if self.watermark is None or not messages:
            return
        advanced = self.watermark.mark_done(messages)
        if advanced:
            self._settling("commit", messages, lambda s: s.commit(advanced))

    def _settling(self, doing: str, messages: Sequence[Message], call: Callable[[Subscription], Any]) -> Any:
        """``call`` (``doing``: ack, nack, dead_letter, commit) on the membership that fetched the
        ``messages`` being settled, guarded.

        Once an outage made the worker leave (a nack or dead letter of the same
        batch failed, say), the rest of the batch is not settled through a new
        membership, which never held those messages: they come back to the group
        and are skipped by their tokens. An outage met here is logged with what
        was being settled: those messages come again.

        An ack or a commit the server refused (a `TransportError` raised from the
        client library's error: a channel RabbitMQ closed, a commit for a topic
        deleted under the member) is met the same way: the handler's effects are
        committed with its token, so the message coming again is harmless, and the
        membership that could not settle it is left. A nack or dead letter refused
        has its own way out (`_hand_back`); a refusal without such a cause is a
        check of our own and still ends the run.
        """
        subscription = self._subscription
        if subscription is None:
            return FAILED
        fields = {"settling": doing, "messages": [m.id for m in messages]}
        try:
            return self._guarded(lambda: call(subscription), **fields)
        except TransportError as exc:
            if doing not in ("ack", "commit") or exc.__cause__ is None:
                raise
            self._leave()
            error = str(exc)
            self._reconnect.failed(lambda failures, delay: log.error(
                "transport_settle_refused", handler=self.handler.name, failures=failures,
                retry_in=round(delay, 3), error=error, **fields), self.stopping)
            return FAILED

    def _guarded(self, call: Callable[[], Any], **settling: Any) -> Any:
        """``call()``, or `FAILED` after a transport outage (logged, with ``settling``'s fields
        where it settled messages; the worker subscribes again)."""
        try:
            result = call()
        except WritesRefusedError as exc:  # reachable, refusing writes: the membership is kept
            error = str(exc)
            event = "transport_disk_full" if isinstance(exc, DiskFullError) else "transport_writes_refused"
            self._reconnect.failed(lambda failures, delay: log.warning(
                event, handler=self.handler.name, failures=failures,
                retry_in=round(delay, 3), error=error, **settling), self.stopping)
            return FAILED
        except BackendUnavailableError as exc:
            self._leave()
            error = str(exc)
            self._reconnect.failed(lambda failures, delay: log.warning(
                "transport_unavailable", handler=self.handler.name, failures=failures,
                retry_in=round(delay, 3), error=error, **settling), self.stopping)
            return FAILED
        if failures := self._reconnect.succeeded():
            log.info("transport_reconnected", handler=self.handler.name, after_failures=failures)
        return result

    def _leave(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        self.strategy.forget()  # held acks belong to the membership being left
        try:
            subscription.close()
        except Exception as exc:  # leaving a group over a dead connection: nothing to save
            log.info("group_left_uncleanly", handler=self.handler.name, error=str(exc))
