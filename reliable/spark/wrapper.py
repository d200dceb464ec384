"""``@foreach_batch``: a Spark ``foreachBatch`` function with the framework's guarantees.

For each micro-batch, in this order:

1. find the run (the streaming query's id, see `fence.run_identity`);
2. on the executors: every row marked with its token, the optional
   ``validate`` step run, poison rows set aside, the rows cached unless
   reading them again gives the same rows (`batch.prepare`); the driver
   collects the tokens (not the rows), before any store lock is taken;
3. open a store transaction and fence the batch: a replay of a committed batch
   is skipped (logged), a fresh checkpoint reusing the name is a
   `FenceConflictError`;
4. claim the tokens the cache does not know (the claim records the new ones
   and reveals the known ones; the rows of every known token are dropped on
   the executors) and record the poison rows whose token is not known, in the
   transaction;
5. call the user's function with the claimed rows, the batch id and the
   transaction; its store writes commit with the fence and the tokens.
   How the claim and the call go together is the stream's claim strategy
   (`claim`): in order by default; with ``sink="store"`` on PostgreSQL steps
   4 and 5 overlap: the claim is sent ahead of the function, and a token
   found recorded rolls the call back and runs the batch in order (see
   `ahead`);
6. commit, then queue the claimed tokens for the cache (written behind, on a
   background thread, while the next batch runs). The first batch that
   published (``tx.publish``) starts the app's relay on a thread of the
   writer's (`_DriverRelay`): a Spark driver runs no worker to send them. A failure rolls everything
   back and is retried with the redelivery policy's backoff; when the retries
   are spent the query fails (default) or the whole batch is dead-lettered.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import structlog
from pyspark.sql import DataFrame

from backends.errors import ConfigurationError, FenceConflictError
from reliable.errors import TokenMissingError
from reliable.retry import RetriesSpent, call_with_redelivery
from reliable.spark import deadletters
from reliable.spark.ahead import LostBet
from reliable.spark.batch import BatchFunction, PreparedBatch, parse_schema, prepare
from reliable.spark.claim import Claimed
from reliable.spark.deadletters import PoisonRow
from reliable.spark.fence import open_batch, run_identity
from reliable.spark.options import Resolved, WriterOptions, resolve
from reliable.spark.report import BatchReport, BatchStatus

log = structlog.get_logger("reliable.spark")


class _DriverRelay:
    """The app's relay on a thread of its own, started by the first batch that publishes: a
    Spark driver runs no worker whose relay would send what its batches publish. Off with
    ``[outbox] relay = false`` (a ``reliable relay`` sends them instead)."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._running = ExitStack()
        self._started = False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        outbox = getattr(getattr(self._app, "settings", None), "outbox", None)
        if getattr(outbox, "relay", False):
            self._running.enter_context(self._app.relay().running())

    def stop(self) -> None:
        """Stop the relay's thread; rows it has not sent wait for the next relay."""
        self._running.close()
        self._started = False


@dataclass
class _Batch:
    """One call of the wrapped function: its identity, its prepared rows, its phase timings."""

    df: DataFrame
    batch_id: int
    run_id: str
    prepared: PreparedBatch | None = None
    seconds: dict[str, float] = field(default_factory=dict)


class BatchWriter:
    """The wrapped function handed to ``writeStream.foreachBatch`` (see `foreach_batch`)."""

    def __init__(self, func: BatchFunction, app: Any, options: WriterOptions) -> None:
        self.func = func
        self.app = app
        self.options = options
        self.name = options.name
        self._resolved: Resolved | None = None
        self._rng = random.Random()
        self._relay = _DriverRelay(app)
        self.__name__ = getattr(func, "__name__", options.name)
        self.__doc__ = func.__doc__

    def __call__(self, df: DataFrame, batch_id: int) -> BatchReport:
        env = self._env()
        run_id = run_identity(df, self.options.checkpoint_location)
        batch = _Batch(df, int(batch_id), run_id)
        try:
            return self._with_retries(batch, env)
        finally:
            if batch.prepared is not None:
                batch.prepared.release()

    def _with_retries(self, batch: _Batch, env: Resolved) -> BatchReport:
        def retrying(exc: Exception, attempt: int, delay: float) -> None:
            log.warning("spark.batch.retry", name=self.name, batch_id=batch.batch_id,
                        attempt=attempt, delay=delay, error_type=type(exc).__name__,
                        error=str(exc))  # fmt: skip

        try:
            return call_with_redelivery(
                lambda attempt: self._attempt(batch, env, attempt), policy=env.retry,
                classifier=self.options.classifier, clock=env.clock, rng=self._rng,
                propagate=(FenceConflictError,), on_retry=retrying,
            )
        except RetriesSpent as spent:
            return self._give_up(batch, env, spent.error, spent.attempts)

    def _attempt(self, batch: _Batch, env: Resolved, attempt: int) -> BatchReport:
        prepared = self._prepared(batch, env)
        # read before the transaction takes a lock (SQLite)
        poison = self._poison(prepared, env)
        unseen = self._not_in_cache(env, prepared.tokens)
        try:
            claimed = self._transaction(batch, env, prepared, unseen, poison)
        except LostBet as lost:  # rolled back; the strategy claims in order now
            log.info("spark.batch.bet_lost", name=self.name, batch_id=batch.batch_id,
                     reason=str(lost))  # fmt: skip
            claimed = self._transaction(batch, env, prepared, unseen, poison)
        if claimed is None:
            return self._report(batch, BatchStatus.REPLAYED, attempt)
        batch.seconds.update(claimed.seconds)
        return self._committed(batch, env, attempt, prepared, claimed, len(poison))

    def _transaction(self, batch: _Batch, env: Resolved, prepared: PreparedBatch,
                     unseen: list[str], poison: list[PoisonRow]) -> Claimed | None:  # fmt: skip
        """Fence, poison, claim and the function in one store transaction: what the claim
        strategy did, or None for a replay of a committed batch."""
        with env.store.transaction() as tx:
            if not open_batch(tx, self.name, batch.batch_id, batch.run_id):
                return None
            self._record_poison(tx, batch, poison, env)
            claimed = env.claim(tx, unseen, lambda writes, tokens: self.func(prepared.rows(tokens), batch.batch_id, writes))
        if tx.published:  # committed: the relay sends them
            self._relay.start()
        return claimed

    def _committed(self, batch: _Batch, env: Resolved, attempt: int, prepared: PreparedBatch,
                   claimed: Claimed, poison: int) -> BatchReport:  # fmt: skip
        env.guard.remember(claimed.tokens)
        duplicates = len(prepared.tokens) - len(claimed.tokens)
        report = self._report(batch, BatchStatus.COMMITTED, attempt, len(claimed.tokens), duplicates,
                              poison, ahead=claimed.ahead)  # fmt: skip
        log.info("spark.batch.committed", **report.fields())
        return report

    def _prepared(self, batch: _Batch, env: Resolved) -> PreparedBatch:
        if batch.prepared is None:
            started = env.clock.monotonic()
            schema = parse_schema(self.options.schema)
            batch.prepared = prepare(batch.df, token=self.options.token,
                                     validate=self.options.validate, schema=schema,
                                     cache=self.options.cache)  # fmt: skip
            batch.seconds["prepare"] = env.clock.monotonic() - started
        return batch.prepared

    def _poison(self, prepared: PreparedBatch, env: Resolved) -> list[PoisonRow]:
        """The poison rows to dead-letter: not those whose token is already recorded (a bad
        copy of a row processed before is a duplicate, not poison), nor those whose token is
        already in the dead-letter table (a copy of a poison row is dead-lettered once)."""
        tokens = [p.token for p in prepared.poison if p.token]
        known = env.store.known(self.name, tokens)
        if tokens and self.options.dead_letters is not None:  # and not one dead-lettered before
            with env.store.transaction() as tx:
                known |= deadletters.tokens_in(tx.connection, self.options.dead_letters, self.name, tokens)
        return [p for p in prepared.poison if p.token not in known]

    def _record_poison(
        self, tx: Any, batch: _Batch, poison: list[PoisonRow], env: Resolved
    ) -> None:
        if not poison:
            return
        table = self.options.dead_letters
        if table is None:
            raise TokenMissingError(
                f"foreach_batch {self.name!r}: {len(poison)} rows of batch {batch.batch_id} "
                f"have no {self.options.token!r} and there is no dead_letters table to put them in"
            )
        letters = deadletters.letters_from(poison, name=self.name, batch_id=batch.batch_id,
                                           run_id=batch.run_id, failed_at=env.clock.time())  # fmt: skip
        deadletters.record(tx.connection, table, letters)
        log.warning("spark.batch.poison", name=self.name, batch_id=batch.batch_id,
                    rows=len(letters), dead_letters=table)  # fmt: skip

    def _not_in_cache(self, env: Resolved, tokens: list[str]) -> list[str]:
        """The tokens the cache does not know (a shortcut: the claim finds every known one)."""
        seen = env.guard.cached(tokens)  # empty when there is no cache, or it is down (logged)
        return [token for token in tokens if token not in seen] if seen else tokens

    def flush(self) -> None:
        """Wait until the tokens of every committed batch are in the cache (they are written
        behind, while the next batch runs)."""
        if self._resolved is not None:
            self._resolved.guard.flush()

    def close(self) -> None:
        """Flush, and stop the relay the batches started (once the query has stopped)."""
        self.flush()
        self._relay.stop()

    # -- retries spent --------------------------------------------------------

    def _give_up(self, batch: _Batch, env: Resolved, exc: Exception, attempts: int) -> BatchReport:
        fields = {"name": self.name, "batch_id": batch.batch_id, "run_id": batch.run_id,
                  "attempts": attempts, "error_type": type(exc).__name__, "error": str(exc)}  # fmt: skip
        if self.options.on_retries_spent == "fail":
            log.error("spark.batch.failed", **fields)
            raise exc
        try:
            report = self._dead_letter_batch(batch, env, exc, attempts)
        except Exception as failure:
            log.error("spark.batch.failed", **fields, dead_letter_error=str(failure))
            raise exc from failure
        log.error("spark.batch.dead_lettered", **fields, rows=report.poison)
        return report

    def _dead_letter_batch(
        self, batch: _Batch, env: Resolved, exc: Exception, attempts: int
    ) -> BatchReport:
        """Fence the batch and move all its rows to the dead-letter table; no token is claimed."""
        assert self.options.dead_letters is not None
        prepared = self._prepared(batch, env)
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        rows = prepared.collect_rows()
        known = env.store.known(self.name, [token for token, _ in rows])  # duplicates stay out
        failed = [PoisonRow(token, deadletters.row_json(row), type(exc).__name__, error)
                  for token, row in rows if token not in known]
        poison = self._poison(prepared, env)
        letters = deadletters.letters_from(failed, name=self.name, batch_id=batch.batch_id,
                                           run_id=batch.run_id, failed_at=env.clock.time(),
                                           scope=deadletters.BATCH)  # fmt: skip
        with env.store.transaction() as tx:
            if not open_batch(tx, self.name, batch.batch_id, batch.run_id):
                return self._report(batch, BatchStatus.REPLAYED, attempts)
            deadletters.record(tx.connection, self.options.dead_letters, letters)
            self._record_poison(tx, batch, poison, env)
        return self._report(batch, BatchStatus.DEAD_LETTERED, attempts,
                            poison=len(letters) + len(poison))

    # -- helpers --------------------------------------------------------------

    def _env(self) -> Resolved:
        if self._resolved is None:
            resolved = resolve(self.app, self.options)
            if self.options.dead_letters is not None:
                with resolved.store.transaction() as tx:
                    deadletters.ensure_table(tx.connection, self.options.dead_letters)
            self._resolved = resolved
        return self._resolved

    def _report(self, batch: _Batch, status: BatchStatus, attempts: int, written: int = 0,
                duplicates: int = 0, poison: int = 0, *, ahead: bool = False) -> BatchReport:  # fmt: skip
        cached = batch.prepared is not None and batch.prepared.cached
        return BatchReport(self.name, batch.batch_id, batch.run_id, status, attempts, written,
                           duplicates, poison, cached, ahead, dict(batch.seconds))  # fmt: skip


def foreach_batch(app: Any, **options: Any) -> Callable[[BatchFunction], BatchWriter]:
    """Decorate ``fn(df, batch_id, tx)`` into a ``foreachBatch`` function; see `BatchWriter`.

    Options (checked here, at decoration time; see `WriterOptions.check`):
    ``name`` (the fence name and token namespace), ``token`` (the token
    column), ``retry``, ``fatal``, ``retry_on``, ``dead_letters`` (table
    name), ``validate``, ``schema`` (of the validated rows),
    ``on_retries_spent`` (``"fail"`` or ``"dead_letter"``),
    ``checkpoint_location``, ``ttl``, ``cache`` (always cache the batch's
    rows between the token read and the function; see `batch.rereadable`),
    ``sink`` (``"store"``: every effect of the function goes through ``tx``,
    so the claim may be sent ahead of it; see `ahead`).
    """
    unknown = sorted(set(options) - WriterOptions.OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"foreach_batch: unknown option(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(WriterOptions.OPTIONS))}"
        )
    checked = WriterOptions.check(**options)

    def decorate(func: BatchFunction) -> BatchWriter:
        return BatchWriter(func, app, checked)

    return decorate
