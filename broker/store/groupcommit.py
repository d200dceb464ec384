"""`GroupCommit`: `sync` appends from many producers, written and fsynced together.

Threads (`append`, which blocks) hand their records over and wait. One
committer thread takes everything queued (a *generation*), validates and
encodes it as a single batch, writes it with one system call, fsyncs, and
only then wakes the generation's producers. Before taking a generation it
waits briefly (``group_commit_wait``) for the producers of the previous one
to come back, so that one fsync covers them all and the committer does not
fight them for the GIL. A batch with a bad record is re-encoded producer by
producer, so only the producer that sent it gets the error.

Asyncio tasks (`append_async`: the broker's server) write their records on
their own loop, those of one pass of the loop together (one encoding, one
write), and only the fsync is left to the committer: the loop goes on with
the next writes while the disk works (RocketMQ's GroupCommitService). A generation wakes its tasks with one call into each
event loop, so many concurrent producers on one loop cost a task switch each
rather than a thread switch.

A `Journal` attached to the group commit (the broker's ack journal) rides the
same generations: whoever queued lines in it joins the next generation with
no records (`synced`, `synced_async`), and the committer writes and fsyncs
the journal in the same pass as the log, after it, so one committer and one
wake-up serve appends and acks alike. A journal that fails fails only its
own waiters: the appends of the generation are durable all the same.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from broker.errors import StoreClosedError
from broker.store.prepare import Prepared, prepare
from broker.store.record import Appended, RecordColumns

Written = tuple[Appended, "asyncio.Future[Appended]"]
"""An append its task wrote itself: its places, and the future that gives them after the fsync."""
Commit = Callable[[Prepared], tuple[Appended, int]]
"""Writes a prepared batch (under the store's writer lock); returns where each record landed
and the log end after it."""


class Journal(Protocol):
    """A file written beside the log and fsynced in the same committer pass (`GroupCommit.attach`)."""

    def commit(self) -> None:
        """Write and fsync what was queued in it so far; raise `OSError` if it cannot."""


class Generation:
    """The producers whose records one committer pass wrote; woken together after the fsync."""

    def __init__(self) -> None:
        self.batches: list[RecordColumns] = []
        self.results: list[Appended | BaseException] = []  # one per batch
        self.error: BaseException | None = None
        self.written: dict[asyncio.AbstractEventLoop, list[Written]] = {}
        """Appends their tasks wrote themselves, waiting for the fsync (by event loop)."""
        self.synced: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        """Tasks waiting for the attached journals' fsync only (by event loop)."""
        self.journal_error: BaseException | None = None  # why a journal could not be fsynced
        self.reach = 0  # the log end those appends reached
        self.producers = 0  # batches, and loop writes waiting for the fsync
        self._done = threading.Lock()
        self._done.acquire()

    def finish(self, error: BaseException | None = None) -> None:
        """Wake every producer of the generation (with ``error``, if the flush failed)."""
        if error is not None and self.error is None:
            self.error = error
        self._done.release()
        for loop in {*self.written, *self.synced}:
            try:
                loop.call_soon_threadsafe(self._resolve, self.written.get(loop, ()),
                                          self.synced.get(loop, ()))
            except RuntimeError:  # the loop closed: nobody is waiting there any more
                pass

    def journaled(self) -> None:
        """Return if the generation's journals were fsynced, else raise why not."""
        if self.journal_error is not None:
            raise self.journal_error

    def outcome(self, position: int) -> Appended:
        """Where the records of batch ``position`` landed, or raise why they did not."""
        result = self.results[position] if position < len(self.results) else None
        if isinstance(result, BaseException):
            raise result
        if self.error is not None or result is None:
            raise self.error or StoreClosedError("the store closed before the append")
        return result

    def _resolve(self, written: Sequence[Written], synced: Sequence[asyncio.Future[None]]) -> None:
        """Complete the futures of one event loop's tasks (runs on that loop)."""
        for results, future in written:
            if future.done():  # cancelled: the records are written all the same
                continue
            if self.error is not None:
                future.set_exception(self.error)
            else:
                future.set_result(results)
        for waiting in synced:
            if waiting.done():
                continue
            if self.journal_error is not None:
                waiting.set_exception(self.journal_error)
            else:
                waiting.set_result(None)

    def wait(self) -> None:
        """Sleep until `finish`; then wake the next producer of the generation.

        Producers wake one after another, each passing the lock on, rather than
        all at once: only one or two threads at a time then compete for the GIL.
        """
        self._done.acquire()
        self._done.release()


class GroupCommit:
    """Queues `sync` appends and commits them a generation at a time on its own thread."""

    def __init__(self, check: Callable[[], None], commit: Commit, flush: Callable[[int], None],
                 max_record_size: int, gather: float) -> None:
        self._check = check  # raises if the store may not take appends now (a full disk)
        self._commit = commit
        self._flush = flush  # fsyncs the log up to an offset, or raises
        self._max_record_size = max_record_size
        self._lock = threading.Condition(threading.Lock())
        self._queued = Generation()
        self._expected = 1  # producers the last generation held: worth waiting for again
        self._gather = gather  # the longest wait for them
        self._stopping = False
        self._on_loop: dict[asyncio.AbstractEventLoop, tuple[list[RecordColumns], list[asyncio.Future[Appended]]]] = {}
        """What each event loop's tasks queued for its next write (touched on that loop only)."""
        self._journals: list[Journal] = []
        self._thread = threading.Thread(target=self._run, name="store-committer", daemon=True)
        self._thread.start()

    def append(self, records: RecordColumns) -> Appended:
        """Append ``records``; return once an fsync covers them (or raise what went wrong)."""
        generation, position = self._enqueue(records)
        generation.wait()
        return generation.outcome(position)

    async def append_async(self, records: RecordColumns) -> Appended:
        """`append` for a task on a running event loop: the tasks of one pass of the loop write
        together, on the loop, and await the committer's fsync."""
        loop = asyncio.get_running_loop()
        waiting = self._on_loop.get(loop)
        if waiting is None:
            waiting = self._on_loop[loop] = ([], [])
            loop.call_soon(self._write_on_loop, loop)
        future: asyncio.Future[Appended] = loop.create_future()
        waiting[0].append(records)
        waiting[1].append(future)
        return await future

    def attach(self, journal: Journal) -> None:
        """Commit ``journal`` in every committer pass, after the log."""
        with self._lock:
            self._journals.append(journal)

    def synced(self) -> None:
        """Return once the attached journals are fsynced past what was queued in them before the
        call (or raise why they cannot be)."""
        with self._lock:
            if self._stopping:
                raise StoreClosedError("the store is closing")
            generation = self._queued
            self._joined(generation)
        generation.wait()
        generation.journaled()

    async def synced_async(self) -> None:
        """`synced` for a task on a running event loop: awaits the committer's pass."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._stopping:
                raise StoreClosedError("the store is closing")
            generation = self._queued
            generation.synced.setdefault(loop, []).append(future)
            self._joined(generation)
        await future

    def _write_on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write what the loop's tasks queued in this pass; hand their fsync to the committer."""
        batches, futures = self._on_loop.pop(loop)
        try:
            outcomes, end = self._write_batches(batches)
        except BaseException as exc:  # noqa: BLE001 - the store is now failed: each task hears of it
            outcomes, end = [exc] * len(batches), 0
        written: list[Written] = []
        for outcome, future in zip(outcomes, futures):
            if isinstance(outcome, BaseException):
                if not future.done():
                    future.set_exception(outcome)
            else:
                written.append((outcome, future))
        if not written:
            return
        with self._lock:
            if self._stopping:  # written, but no fsync will come: the close's checkpoint fsyncs them
                for _, future in written:
                    if not future.done():
                        future.set_exception(StoreClosedError("the store is closing"))
                return
            generation = self._queued
            generation.written.setdefault(loop, []).extend(written)
            generation.reach = max(generation.reach, end)
            self._joined(generation)

    def _enqueue(self, records: RecordColumns) -> tuple[Generation, int]:
        """Add ``records`` to the next generation; wake the committer when it is worth it."""
        with self._lock:
            if self._stopping:
                raise StoreClosedError("the store is closing")
            generation = self._queued
            position = len(generation.batches)
            generation.batches.append(records)
            self._joined(generation)
        return generation, position

    def _joined(self, generation: Generation) -> None:
        """A producer joined ``generation`` (lock held): wake the committer for the first, and
        once as many came as last time."""
        generation.producers += 1
        if generation.producers == 1 or generation.producers >= self._expected:
            self._lock.notify()

    def stop(self) -> None:
        """Commit what is queued, then end the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queued.producers and not self._stopping:
                    self._lock.wait()
                self._lock.wait_for(self._gathered, self._gather)
                generation, self._queued = self._queued, Generation()
                self._expected = generation.producers
                stopping = self._stopping
            if generation.producers or stopping:  # the last pass writes what journals still queue
                self._commit_generation(generation)
            if stopping:
                return

    def _gathered(self) -> bool:
        """Whether every producer of the last generation is back, or the store is stopping.

        Waiting for them (at most ``gather`` seconds) keeps generations whole: the
        producers are all asleep while the committer works, so it never waits for
        the GIL, and one fsync covers them all.
        """
        return self._queued.producers >= self._expected or self._stopping

    def _commit_generation(self, generation: Generation) -> None:
        error: BaseException | None = None
        try:
            end = 0
            if generation.batches:
                generation.results, end = self._write_batches(generation.batches)
            self._flush(max(end, generation.reach))
        except BaseException as exc:  # noqa: BLE001 - the store is now failed: every producer hears of it
            error = exc
        for journal in self._journals:  # a failed log leaves the journals' own fsync to be tried
            try:
                journal.commit()
            except BaseException as exc:  # noqa: BLE001 - its waiters hear of it; the appends are durable
                generation.journal_error = exc
        generation.finish(error)

    def _write_batches(self, batches: list[RecordColumns]) -> tuple[list[Appended | BaseException], int]:
        """Write ``batches`` as one, but for bad ones (their error in their place); return each
        batch's places or error, and the log end. Raises if the write itself fails."""
        try:
            self._check()
        except Exception as exc:  # noqa: BLE001 - handed to the producers, never lost
            return [exc] * len(batches), 0
        spans = list[slice | BaseException]()
        start = 0
        for batch in batches:
            spans.append(slice(start, start + batch.length))
            start += batch.length
        prepared: Prepared | None
        try:
            prepared = prepare(batches[0] if len(batches) == 1 else RecordColumns.joined(batches),
                               self._max_record_size)
        except Exception:  # noqa: BLE001 - find the bad batches; commit the good ones together
            good: list[RecordColumns] = []
            spans = [self._validate(batch, good) for batch in batches]
            prepared = prepare(RecordColumns.joined(good), self._max_record_size) if good else None
        if prepared is None:  # every batch was bad
            return [span for span in spans if isinstance(span, BaseException)], 0
        appended, end = self._commit(prepared)
        if len(batches) == 1 and not isinstance(spans[0], BaseException):
            return [appended], end
        return [span if isinstance(span, BaseException) else appended.part(span) for span in spans], end

    def _validate(self, batch: RecordColumns, good: list[RecordColumns]) -> slice | BaseException:
        """The error of a bad batch, or where the good one goes once added to ``good``."""
        try:
            prepare(batch, self._max_record_size)
        except Exception as exc:  # noqa: BLE001 - this producer's error, raised in its thread
            return exc
        start = sum(part.length for part in good)
        good.append(batch)
        return slice(start, start + batch.length)
