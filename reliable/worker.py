"""The consume loop of one handler: fetch with prefetch, dispatch, acknowledge.

With ``concurrency > 1`` messages are dispatched to lanes by key, so messages
with the same key keep their order; offsets are committed only up to the
contiguous prefix of done messages (`OffsetWatermark`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from backends.types import Message
from reliable.commit import CommitStrategy, OffsetWatermark
from reliable.handler import Handler
from reliable.outcome import Outcome, Result
from reliable.pipeline import Pipeline
from reliable.runtime import Runtime

log = structlog.get_logger("reliable.worker")


class Worker:
    """Consumes one handler's topic for its group."""

    def __init__(self, handler: Handler, runtime: Runtime, strategy: CommitStrategy) -> None:
        self.handler = handler
        self.runtime = runtime
        self.strategy = strategy
        self.pipeline = Pipeline(handler, runtime, offsets_in_transaction=strategy.in_transaction)
        self.watermark = OffsetWatermark() if runtime.transport.commits_offsets else None
        self.lanes = handler.config.concurrency
        self._pool = ThreadPoolExecutor(self.lanes, thread_name_prefix=f"reliable-{handler.name}") if self.lanes > 1 else None
        if strategy.in_transaction and runtime.transport.commits_offsets:
            runtime.transport.seek(handler.group, runtime.store.load_offsets(handler.group))

    @property
    def fetch_size(self) -> int:
        return self.handler.batch * self.lanes if self.handler.batch else self.handler.config.prefetch

    def poll(self, timeout: float) -> int:
        """One fetch-and-process cycle; returns how many messages were fetched."""
        transport, group = self.runtime.transport, self.handler.group
        messages = transport.fetch(group, self.handler.topic, self.fetch_size, timeout)
        if messages:
            if self.watermark is not None:
                self.watermark.fetched(messages)
            self._settle(self._dispatch(messages))
        self.strategy.tick(self._ack, self.runtime.clock.time())
        return len(messages)

    def pending(self) -> int:
        return self.runtime.transport.pending(self.handler.group, self.handler.topic)

    def next_due(self) -> float | None:
        return self.runtime.transport.next_due(self.handler.group, self.handler.topic)

    def flush(self) -> None:
        self.strategy.flush(self._ack)
        self.pipeline.guard.flush()

    def close(self) -> None:
        self.flush()
        self.strategy.close()
        self.pipeline.guard.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _dispatch(self, messages: list[Message]) -> list[Result]:
        if self._pool is None:
            return self._process(messages)
        lanes: list[list[Message]] = [[] for _ in range(self.lanes)]
        for m in messages:
            lane_key = m.key if m.key is not None else f"{m.topic}/{m.queue}/{m.offset}"
            lanes[zlib.crc32(lane_key.encode()) % self.lanes].append(m)
        futures = [self._pool.submit(self._process, lane) for lane in lanes if lane]
        return [result for future in futures for result in future.result()]

    def _process(self, messages: list[Message]) -> list[Result]:
        size = self.handler.batch or len(messages)
        return [r for i in range(0, len(messages), size) for r in self.pipeline.process(messages[i : i + size])]

    def _settle(self, results: Sequence[Result]) -> None:
        transport, group = self.runtime.transport, self.handler.group
        moved: list[Message] = []
        for r in results:
            if r.outcome is Outcome.REDELIVERED and r.redelivery is not None:
                transport.nack(group, r.redelivery, r.delay)
                moved.append(r.message)
            elif r.outcome is Outcome.DEAD_LETTERED and r.failure is not None:
                transport.dead_letter(group, r.message, r.failure)
                moved.append(r.message)
            elif r.outcome is Outcome.DEFERRED:
                transport.nack(group, r.message, r.delay)
        self._advance(moved)
        self.strategy.done([r.message for r in results if r.acked], self._ack, self.runtime.clock.time())

    def _ack(self, messages: Sequence[Message]) -> None:
        self.runtime.transport.ack(self.handler.group, messages)
        self._advance(messages)

    def _advance(self, messages: Sequence[Message]) -> None:
        if self.watermark is None or not messages:
            return
        advanced = self.watermark.mark_done(messages)
        if advanced:
            self.runtime.transport.commit(self.handler.group, advanced)
