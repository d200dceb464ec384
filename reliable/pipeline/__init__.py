"""The per-message pipeline: token → cache → claim → handler → commit → cache fill.

The pipeline is one chain of shared steps (`reliable.pipeline.steps`), in
the manner of structlog's processor chain; the steps around ``run`` see the
whole fetch, ``run`` one chunk at a time:

    tokens → repeats → cache → run → dead letters → cache fill → deferrals → after_message

Only the ``run`` step differs between the modes, and how many messages it
sees at a time:
* single: chunks of one message; run = claim, handler and commit in one
  transaction (`transaction.each_in_transaction`);
* batch: the whole batch as one chunk; run = one transaction with the batch
  in a savepoint, each message isolated on failure
  (`transaction.together_in_transaction`);
* lease: chunks of one; run = lease, handler with the lease renewed, stored
  result (`lease.Leased`).
The failure branch is shared: a failing message is classified (redeliver
with the policy's next delay, or dead-letter), and every dead letter is
recorded in the store before the worker hands it to the transport. The
worker turns each `Result` into an ack. The app's middleware
(`reliable.middleware`) sees every message go in, every handler call, retry
and dead letter, and every outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import structlog

from backends.types import Message
from reliable.commit import OffsetWatermark
from reliable.handler import Handler
from reliable.middleware import Middlewares
from reliable.outcome import Outcome, Result
from reliable.pipeline.lease import InProgress, Leased
from reliable.pipeline.runner import Inline, Runner, drive
from reliable.pipeline.steps import Step, Steps, Work
from reliable.pipeline.transaction import each_in_transaction, together_in_transaction
from reliable.reporting import built_in
from reliable.runtime import Runtime

log = structlog.get_logger("reliable.pipeline")

__all__ = ["Pipeline"]


class Pipeline:
    """Runs one handler's messages through the chain of steps against a runtime.

    With ``offsets`` (the transactional commit strategy on a transport whose
    consumer keeps offsets), every transaction also saves where its queues
    stand once its messages are done: the contiguous prefix of the watermark,
    never past a message still in flight. ``in_progress`` tells the
    transport a leased message is still being worked on. ``middleware``: the
    app's (`App.middleware`); by default the built-in ones alone.
    """

    def __init__(self, handler: Handler, runtime: Runtime, offsets: OffsetWatermark | None = None,
                 in_progress: InProgress | None = None, runner: Runner | None = None,
                 middleware: Middlewares | None = None) -> None:
        self.handler = handler
        self.middleware = middleware if middleware is not None else Middlewares(built_in(runtime.counters))
        self.runner = runner or Inline(runtime.store, runtime.clock)
        self.steps = Steps(handler, runtime, offsets, self.middleware, self.runner)
        self.guard = self.steps.guard
        run: Step
        if handler.lease is not None:
            run = Leased(self.steps, in_progress)
        elif handler.batch:
            run = partial(together_in_transaction, self.steps)
        else:
            run = partial(each_in_transaction, self.steps)
        s = self.steps
        self.before: list[Step] = [s.tokens, s.repeats, s.cached]
        self.run_chunk = run
        self.after: list[Step] = [s.dead_letters, s.remember, s.count_deferrals]
        self.chunk = handler.batch or 1

    def process(self, messages: Sequence[Message], stopping: Callable[[], bool] = lambda: False) -> list[Result]:
        """`run` for a sync handler, on the calling thread (its runner is `Inline`)."""
        return drive(self.run(messages, stopping))

    async def run(self, messages: Sequence[Message], stopping: Callable[[], bool] = lambda: False) -> list[Result]:
        """Run ``messages`` through the chain; one `Result` per message, in order.

        The steps before ``run`` see the whole fetch (one cache round trip for
        it); ``run`` sees one chunk at a time (a batch, or one message). Once
        ``stopping()`` is true no further chunk starts: the messages left get
        no result (unacknowledged, they go back to the group).
        """
        work = [Work(m) for m in messages]
        self.middleware.each("before_message", self.handler, messages)
        done: list[Work] = []
        try:
            for step in self.before:
                await step(work)
            for start in range(0, len(work), self.chunk):
                if stopping():
                    log.info("worker_stopping", handler=self.handler.name, handed_back=len(work) - start)
                    break
                chunk = work[start : start + self.chunk]
                await self.run_chunk(chunk)
                done += chunk
            for step in self.after:
                await step(done)
        except BaseException:
            self._report(work, [])  # nothing is acked: every message comes back
            raise
        self._report(work, done)
        results = []
        for w in done:
            assert w.result is not None, f"no step decided message {w.message.id}"
            results.append(w.result)
        return results

    def _report(self, work: list[Work], done: list[Work]) -> None:
        """``on_dead_letter``, then every message's outcome (None: handed back undecided)."""
        middleware, handler = self.middleware, self.handler
        if middleware.overridden("on_dead_letter"):
            for w in done:
                if w.result is not None and w.result.outcome is Outcome.DEAD_LETTERED:
                    middleware.emit("on_dead_letter", handler, w.result)
        if len(done) == len(work):
            middleware.outcomes(handler, [(w.message, w.result) for w in work])
        else:
            finished = {id(w) for w in done}
            middleware.outcomes(handler, [(w.message, w.result if id(w) in finished else None) for w in work])
