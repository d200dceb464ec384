"""The relay: publishes committed outbox rows to the transport, in order per key, and marks them sent.

A handler (or any code holding a store transaction) writes messages with
``tx.publish(...)``: rows of the outbox, committed or rolled back with its
other writes (`backends.store.outbox`). A relay claims the next rows that
may go (`SqlOutbox.claim`), publishes them with the message id each row was
given (the same on every resend, so a transport that drops copies by id
drops a resend, and elsewhere the consumer's default token, the message id,
makes it a duplicate), and marks them sent in the same transaction, only
after the transport confirmed them. One pass:

    claim rows → publish runs of one topic, in id order → mark sent → commit

A transport that refuses a row for good (not an outage), or whose client
library fails on it with an error of its own, gets it marked FAILED with
the reason; the rows of its key wait behind it until ``reliable outbox
retry``. An outage of the transport or the store commits
what was confirmed, then waits with a growing backoff (tenacity) and tries
again: a row is never lost, at worst sent again.

A relay runs inside every worker (`App.run`) and standalone (``reliable
relay``). It waits for a commit to wake it (`Wakeup`, in process; PostgreSQL
``NOTIFY`` across processes), else polls every ``outbox.poll_interval``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import groupby

import structlog
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_when_event_set,
    wait_random_exponential,
)
from tenacity.stop import StopBaseT

from backends.clock import Clock
from backends.errors import (
    BackendRefusedError,
    BackendUnavailableError,
    OutboxMessageError,
    ReliableError,
    TransportError,
)
from backends.store.base import Store
from backends.store.outbox import Claimed, OutboxRow
from backends.store.outbox_writer import PublishHook
from backends.transport.base import Transport
from reliable import metrics
from reliable.retry import Backoff
from reliable.settings import OutboxSettings

log = structlog.get_logger("reliable.outbox")

RETENTION_CHECK = 60.0
"""Seconds between deletions of sent rows older than the retention."""
METRICS_REFRESH = 1.0
"""Seconds between refreshes of the backlog metrics by a running relay."""
FIRST_BACKOFF = 0.05
"""Seconds: the scale of the first waits after an outage (growing to ``max_backoff``)."""
MAX_PASS = 5000
"""Rows a pass may grow to while a backlog lasts (``batch_size`` when that is larger)."""
QUICK_PASS = 0.05
"""Seconds: a full pass quicker than this takes twice the rows next time. Its fixed costs (the
commit, the round trips: 1 ms on SQLite, 3 on PostgreSQL) then weigh on more rows; a slower
pass is mostly per-row work already, and on SQLite it holds the database's write lock."""

RelayHook = Callable[[str, Sequence[Mapping[str, str]]], AbstractContextManager[object]]
"""Around each send of rows of a topic, given their headers (`Middlewares.relaying`)."""


def _no_hook(topic: str, rows: Sequence[Mapping[str, str]]) -> AbstractContextManager[object]:
    return nullcontext()


def checked_publish(transport: Transport, hook: PublishHook) -> PublishHook:
    """``hook`` after ``transport``'s check of the topic (`Transport.check_topic`): a name it never
    takes is refused at ``tx.publish`` (`OutboxMessageError`: the handler's transaction fails)
    instead of a row the relay marks failed, every later row of its key held behind it."""
    def publishing(topic: str, headers: Mapping[str, str] | None) -> AbstractContextManager[Mapping[str, str]]:
        try:
            transport.check_topic(topic)
        except TransportError as exc:
            raise OutboxMessageError(f"tx.publish to {topic!r}: {exc}") from exc
        return hook(topic, headers)
    return publishing


class _Pass:
    """One claimed batch on its way to the transport: what was confirmed, refused, or cut short."""

    def __init__(self, claimed: Claimed, now: float) -> None:
        self.claimed, self.now = claimed, now
        self.sent: list[OutboxRow] = []
        self.failed = 0
        self.refused_keys: set[str] = set()  # a row of the key was refused: the rest wait behind it
        self.outage: BackendUnavailableError | None = None

    def may_send(self, row: OutboxRow) -> bool:
        return row.key is None or row.key not in self.refused_keys

    def refuse(self, row: OutboxRow, exc: Exception) -> None:
        self.claimed.failed(row, f"{type(exc).__name__}: {exc}")
        self.failed += 1
        if row.key is not None:
            self.refused_keys.add(row.key)
        log.error("outbox_row_refused", row=row.id, topic=row.topic, key=row.key, error=str(exc))


def _batches(rows: Sequence[OutboxRow], size: int) -> Iterator[tuple[str, list[OutboxRow]]]:
    """``rows`` in runs of one topic, in their order, each cut into sends of ``size`` rows at most."""
    for topic, run in groupby(rows, key=lambda r: r.topic):
        listed = list(run)
        for at in range(0, len(listed), size):
            yield topic, listed[at : at + size]


class Relay:
    """Sends one store's outbox to one transport."""

    def __init__(self, store: Store, transport: Transport, settings: OutboxSettings, clock: Clock,
                 declare: Callable[[str], None] = lambda topic: None, hook: RelayHook = _no_hook) -> None:
        self.outbox = store.outbox
        self.transport, self.settings, self.clock = transport, settings, clock
        self._declare = declare  # groups that must exist before a topic's first publish (amqp://)
        self._hook = hook  # the app's middleware around each send (a tracing span)
        self._limit = settings.batch_size  # rows the next pass claims (`_pace`)
        self._purged_at = float("-inf")
        self._reported_at = float("-inf")
        # `drain`'s waits through one outage, grown over its calls (the caller's loop retries)
        self._draining = Backoff(clock, wait_random_exponential(multiplier=FIRST_BACKOFF, max=settings.max_backoff))

    # -- one pass ---------------------------------------------------------------------------

    def step(self) -> int:
        """Claim and send one batch; return how many rows it settled (sent or refused).

        After an outage the rows the transport confirmed are committed as sent,
        then the outage is raised (`BackendUnavailableError`).
        """
        started, size = self.clock.monotonic(), self.settings.batch_size
        with self.outbox.claim(self._limit) as claimed:
            done = _Pass(claimed, self.clock.time())
            for topic, batch in _batches(claimed.rows, size):
                self._send(done, topic, [r for r in batch if done.may_send(r)])
                if done.outage is not None:
                    break
            claimed.sent(done.sent)
        self._pace(len(claimed.rows), self.clock.monotonic() - started)
        metrics.outbox_rows(self.outbox.name, "sent", len(done.sent))
        metrics.outbox_rows(self.outbox.name, "failed", done.failed)
        if done.outage is not None:
            raise done.outage
        return len(done.sent) + done.failed

    def _pace(self, claimed: int, took: float) -> None:
        """The next pass's size: twice this one's after a full and quick pass (a backlog), up to
        `MAX_PASS`; half after a full and slow one; ``batch_size`` once a pass finds fewer rows."""
        if claimed < self._limit:  # the backlog is sent
            self._limit = self.settings.batch_size
        elif took < QUICK_PASS:
            self._limit = min(2 * self._limit, max(MAX_PASS, self.settings.batch_size))
        else:
            self._limit = max(self._limit // 2, self.settings.batch_size)

    def _send(self, done: _Pass, topic: str, run: list[OutboxRow]) -> None:
        """Publish ``run`` (rows of ``topic``); refused as a whole, each row again alone."""
        try:
            self._publish(topic, run, done.now)
        except BackendUnavailableError as exc:
            done.outage = exc
        except ReliableError as exc:
            if not isinstance(exc, TransportError):  # settings refused: the relay stops
                raise
            self._each_alone(done, run)
        except Exception:  # the client library's own failure: on which row, each alone tells
            self._each_alone(done, run)
        else:
            done.sent += run

    def _each_alone(self, done: _Pass, run: list[OutboxRow]) -> None:
        """``run`` was refused as a whole: each row again alone, so only the one at fault fails."""
        for row in run:
            if done.outage is None and done.may_send(row):
                self._send_alone(done, row)

    def _send_alone(self, done: _Pass, row: OutboxRow) -> None:
        try:
            self._publish(row.topic, [row], done.now)
        except BackendUnavailableError as exc:
            done.outage = exc
        except ReliableError as exc:
            if not isinstance(exc, TransportError):
                raise
            done.refuse(row, exc)
        except Exception as exc:  # a client library's own failure on this row: it stalled the whole outbox
            log.exception("outbox_row_failed_in_client", row=row.id, topic=row.topic, error=str(exc))
            done.refuse(row, exc)
        else:
            done.sent.append(row)

    def _publish(self, topic: str, rows: Sequence[OutboxRow], now: float) -> None:
        if rows:
            self._declare(topic)
            with self._hook(topic, [r.headers for r in rows]):
                self.transport.publish(topic, [r.outgoing(now) for r in rows])

    # -- loops ------------------------------------------------------------------------------

    def drain(self, stopping: threading.Event | None = None) -> bool:
        """Send until nothing more may be sent now; `App.run(until_idle=True)` calls it between
        deliveries. True when rows were settled, or when the store or transport is down (after
        a wait that grows over the calls of one outage, as a worker's reconnects do: a drain
        that began its backoff anew made a store that stays down be retried, and logged, many
        times a second): the outbox is not idle yet."""
        total = 0
        try:
            while settled := self.step():
                total += settled
        except BackendUnavailableError as exc:
            error = str(exc)
            self._draining.failed(lambda attempt, wait: log.warning(
                "relay_backoff", outbox=self.outbox.name, attempt=attempt, retry_in=round(wait, 3), error=error),
                stopping)
            return True
        self._draining.succeeded()
        return total > 0

    def run(self, stopping: threading.Event) -> None:
        """Send as rows are committed until ``stopping`` is set (a worker's thread, ``reliable relay``)."""
        listener = threading.Thread(target=self.outbox.listen, args=(stopping,), daemon=True,
                                    name=f"reliable-outbox-listen-{self.outbox.name}")
        listener.start()
        log.info("relay_started", outbox=self.outbox.name)
        try:
            while not stopping.is_set():
                seen = self.outbox.wakeup.generation
                try:
                    settled = self._attempt(stopping)
                except BackendRefusedError:  # the settings are wrong: no retry fixes them
                    raise
                except Exception as exc:  # not an outage (a bug, a refused statement): keep relaying
                    log.exception("relay_failed", outbox=self.outbox.name, error=str(exc))
                    settled = 0
                self._housekeeping()
                if not settled:
                    log.debug("relay_waiting", outbox=self.outbox.name)
                    self.outbox.wakeup.wait(seen, self.settings.poll_interval)
        finally:
            listener.join(timeout=2.0)
            log.info("relay_stopped", outbox=self.outbox.name)

    @contextmanager
    def running(self, stop: threading.Event | None = None) -> Iterator[threading.Thread]:
        """`run` on a thread of its own while the block runs; stopped and joined after it.

        A refusal of the settings (`BackendRefusedError`) ends the relay: it sets ``stop``, so
        the caller's loop ends, and is raised when the block is left.
        """
        stopping = threading.Event()
        refused: list[BackendRefusedError] = []

        def relay() -> None:
            try:
                self.run(stopping)
            except BackendRefusedError as exc:
                refused.append(exc)
                if stop is not None:
                    stop.set()

        thread = threading.Thread(target=relay, daemon=True, name=f"reliable-relay-{self.outbox.name}")
        thread.start()
        try:
            yield thread
        finally:
            stopping.set()
            self.outbox.wakeup.notify()
            thread.join()
        if refused:
            raise refused[0]

    def _attempt(self, stopping: threading.Event) -> int:
        """`step`, with outages retried after a growing, jittered wait; 0 once ``stopping``."""
        def wait(seconds: float) -> None:  # a wall-time wait that `stopping` cuts short
            stopping.wait(seconds)

        try:
            return self._retrying(wait, stop_when_event_set(stopping))(self.step)
        except BackendUnavailableError:
            return 0  # stopping during an outage: the rows wait for the next relay

    def _retrying(self, sleep: Callable[[float], None], stop: StopBaseT) -> Retrying:
        return Retrying(
            retry=retry_if_exception_type(BackendUnavailableError),
            wait=wait_random_exponential(multiplier=FIRST_BACKOFF, max=self.settings.max_backoff),
            stop=stop,
            sleep=sleep,
            before_sleep=self._outage,
            reraise=True,
        )

    def _outage(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("relay_backoff", outbox=self.outbox.name, attempt=state.attempt_number,
                    retry_in=round(wait, 3), error=str(error))

    def _housekeeping(self) -> None:
        """Refresh the backlog metrics and delete sent rows past the retention, each now and then."""
        now, tick = self.clock.time(), self.clock.monotonic()  # rows' times are wall times
        try:
            if tick - self._reported_at >= METRICS_REFRESH:
                self._reported_at = tick
                status = self.outbox.status()
                metrics.outbox_backlog(self.outbox.name, status.backlog, status.oldest_unsent_age(now))
            if tick - self._purged_at >= RETENTION_CHECK:
                self._purged_at = tick
                purged = self.outbox.purge_sent(now - self.settings.retention)
                if purged:
                    log.info("outbox_sent_rows_purged", outbox=self.outbox.name, count=purged)
        except BackendUnavailableError as exc:
            log.warning("relay_housekeeping_failed", outbox=self.outbox.name, error=str(exc))
