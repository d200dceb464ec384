"""``@foreach_batch``: a Spark ``foreachBatch`` function with the framework's guarantees.

For each micro-batch, in this order:

1. find the run (the streaming query's id, see `fence.run_identity`);
2. on the executors: one row per token, rows whose token is known dropped,
   the optional ``validate`` step run, poison rows set aside (`batch.prepare`),
   before any store lock is taken;
3. open a store transaction and fence the batch: a replay of a committed batch
   is skipped (logged), a fresh checkpoint reusing the name is a
   `FenceConflictError`;
4. claim the surviving tokens and record the poison rows, in the transaction;
5. call the user's function with the claimed rows, the batch id and the
   transaction; its store writes commit with the fence and the tokens;
6. commit, then fill the cache. A failure rolls everything back and is retried
   with the redelivery policy's backoff; when the retries are spent the query
   fails (default) or the whole batch is dead-lettered.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from backends.errors import CacheUnavailableError, ConfigurationError, FenceConflictError
from reliable.errors import TokenMissingError
from reliable.retry import (
    Classifier,
    DelayLevels,
    RedeliveryPolicy,
    Verdict,
    build_classifier,
    classify,
)
from reliable.spark import deadletters
from reliable.spark.batch import BatchFunction, PreparedBatch, parse_schema, prepare
from reliable.spark.fence import open_batch, run_identity
from reliable.spark.options import Resolved, resolve
from reliable.spark.report import BatchReport, BatchStatus
from reliable.spark.rows import Validate
from reliable.spark.tokens import KnownTokens

log = structlog.get_logger("reliable.spark")

OnRetriesSpent = Literal["fail", "dead_letter"]


@dataclass
class _Batch:
    """One call of the wrapped function: its identity and, once computed, its prepared rows."""

    df: DataFrame
    batch_id: int
    run_id: str
    as_of: float
    prepared: PreparedBatch | None = None


class BatchWriter:
    """The wrapped function handed to ``writeStream.foreachBatch`` (see `foreach_batch`)."""

    def __init__(
        self,
        func: BatchFunction,
        app: Any,
        *,
        name: str,
        token: str,
        retry: RedeliveryPolicy | DelayLevels | None = None,
        fatal: tuple[type[BaseException], ...] = (),
        retry_on: tuple[type[BaseException], ...] | None = None,
        dead_letters: str | None = None,
        validate: Validate | None = None,
        schema: StructType | str | None = None,
        on_retries_spent: OnRetriesSpent = "fail",
        checkpoint_location: str | None = None,
        ttl: float | None = None,
        store_url: str | None = None,
    ) -> None:
        self.func = func
        self.app = app
        self.name = _text("name", name)
        self.token = _text("token", token)
        self.classifier: Classifier = build_classifier(fatal=fatal, retry_on=retry_on)
        self.retry = retry
        if retry is not None and not isinstance(retry, RedeliveryPolicy | DelayLevels):
            raise ConfigurationError(
                f"retry={retry!r} is not allowed; expected a RedeliveryPolicy or DelayLevels"
            )
        if on_retries_spent not in ("fail", "dead_letter"):
            raise ConfigurationError(
                f"on_retries_spent={on_retries_spent!r} is not allowed; expected 'fail' or 'dead_letter'"
            )
        if validate is not None and not callable(validate):
            raise ConfigurationError(f"validate={validate!r} is not callable")
        needs_table = validate is not None or on_retries_spent == "dead_letter"
        if needs_table and dead_letters is None:
            raise ConfigurationError(
                f"foreach_batch {self.name!r}: validate= and on_retries_spent='dead_letter' need "
                "dead_letters='<table>' to put refused rows in"
            )
        self.dead_letters = (
            None if dead_letters is None else deadletters.table_for(dead_letters).name
        )
        self.validate = validate
        self._schema = schema if schema is None or isinstance(schema, StructType) else _ddl(schema)
        self.on_retries_spent = on_retries_spent
        self.checkpoint_location = checkpoint_location
        self._ttl = ttl
        self._store_url = store_url
        self._options: Resolved | None = None
        self._rng = random.Random()
        self.__name__ = getattr(func, "__name__", self.name)
        self.__doc__ = func.__doc__

    def __call__(self, df: DataFrame, batch_id: int) -> BatchReport:
        options = self._resolved()
        batch = _Batch(
            df, int(batch_id), run_identity(df, self.checkpoint_location), options.clock.time()
        )
        try:
            return self._with_retries(batch, options)
        finally:
            if batch.prepared is not None:
                batch.prepared.release()

    # -- the retry loop -------------------------------------------------------

    def _with_retries(self, batch: _Batch, options: Resolved) -> BatchReport:
        delay: float | None = None
        attempt = 1
        while True:
            try:
                return self._attempt(batch, options, attempt)
            except Exception as exc:
                if isinstance(exc, FenceConflictError):
                    raise
                verdict = classify(exc, self.classifier)
                retry = options.retry
                if verdict is Verdict.FATAL or retry is None or retry.gives_up(attempt):
                    return self._give_up(batch, options, exc, attempt)
                delay = retry.next_delay(delay, self._rng, attempt)
                log.warning(
                    "spark.batch.retry",
                    name=self.name,
                    batch_id=batch.batch_id,
                    attempt=attempt,
                    delay=delay,
                    error_type=type(exc).__name__,
                    error=str(exc),
                )
                options.clock.sleep(delay)
                attempt += 1

    def _attempt(self, batch: _Batch, options: Resolved, attempt: int) -> BatchReport:
        # The executors read the store before the batch transaction takes any lock (SQLite).
        prepared = self._prepared(batch, options)
        with options.store.transaction() as tx:
            if not open_batch(tx, self.name, batch.batch_id, batch.run_id):
                return self._report(batch, BatchStatus.REPLAYED, attempt)
            claimed = (
                tx.claim(self.name, prepared.tokens, options.token_ttl)
                if prepared.tokens
                else set()
            )
            self._record_poison(tx, batch, prepared, options)
            self.func(prepared.rows(claimed), batch.batch_id, tx)
        self._remember(options, claimed)
        report = self._report(
            batch,
            BatchStatus.COMMITTED,
            attempt,
            len(claimed),
            len(prepared.tokens) - len(claimed),
            len(prepared.poison),
        )
        log.info("spark.batch.committed", **report.fields())
        return report

    def _prepared(self, batch: _Batch, options: Resolved) -> PreparedBatch:
        if batch.prepared is None:
            known = KnownTokens(options.store_url, self.name, batch.as_of, options.cache_url)
            batch.prepared = prepare(
                batch.df,
                token=self.token,
                known=known,
                validate=self.validate,
                schema=parse_schema(self._schema),
            )
        return batch.prepared

    def _record_poison(
        self, tx: Any, batch: _Batch, prepared: PreparedBatch, options: Resolved
    ) -> None:
        if not prepared.poison:
            return
        if self.dead_letters is None:
            raise TokenMissingError(
                f"foreach_batch {self.name!r}: {len(prepared.poison)} rows of batch {batch.batch_id} "
                f"have no {self.token!r} and there is no dead_letters table to put them in"
            )
        letters = deadletters.letters_from(
            prepared.poison,
            name=self.name,
            batch_id=batch.batch_id,
            run_id=batch.run_id,
            failed_at=options.clock.time(),
        )
        deadletters.record(tx.connection, self.dead_letters, letters)
        log.warning(
            "spark.batch.poison",
            name=self.name,
            batch_id=batch.batch_id,
            rows=len(letters),
            dead_letters=self.dead_letters,
        )

    def _remember(self, options: Resolved, claimed: set[str]) -> None:
        if options.cache is None or not claimed:
            return
        try:
            options.cache.remember(self.name, sorted(claimed), options.cache_ttl)
        except CacheUnavailableError as exc:  # the store has them; the cache is only a shortcut
            log.warning("spark.cache.unavailable", name=self.name, error=str(exc))

    # -- retries spent --------------------------------------------------------

    def _give_up(
        self, batch: _Batch, options: Resolved, exc: Exception, attempts: int
    ) -> BatchReport:
        fields = {
            "name": self.name,
            "batch_id": batch.batch_id,
            "run_id": batch.run_id,
            "attempts": attempts,
            "error_type": type(exc).__name__,
            "error": str(exc),
        }
        if self.on_retries_spent == "fail":
            log.error("spark.batch.failed", **fields)
            raise exc
        try:
            report = self._dead_letter_batch(batch, options, exc, attempts)
        except Exception as failure:
            log.error("spark.batch.failed", **fields, dead_letter_error=str(failure))
            raise exc from failure
        log.error("spark.batch.dead_lettered", **fields, rows=report.poison)
        return report

    def _dead_letter_batch(
        self, batch: _Batch, options: Resolved, exc: Exception, attempts: int
    ) -> BatchReport:
        """Fence the batch and move all its rows to the dead-letter table; no token is claimed."""
        assert self.dead_letters is not None
        error = {"error_type": type(exc).__name__, "error_message": _describe(exc)}
        prepared = self._prepared(batch, options)
        with options.store.transaction() as tx:
            if not open_batch(tx, self.name, batch.batch_id, batch.run_id):
                return self._report(batch, BatchStatus.REPLAYED, attempts)
            failed = [
                {"token": token, "row_json": deadletters.row_json(row), **error}
                for token, row in prepared.collect_rows()
            ]
            letters = deadletters.letters_from(
                failed,
                name=self.name,
                batch_id=batch.batch_id,
                run_id=batch.run_id,
                failed_at=options.clock.time(),
                scope=deadletters.BATCH,
            )
            deadletters.record(tx.connection, self.dead_letters, letters)
            self._record_poison(tx, batch, prepared, options)
        return self._report(
            batch, BatchStatus.DEAD_LETTERED, attempts, 0, 0, len(letters) + len(prepared.poison)
        )

    # -- helpers --------------------------------------------------------------

    def _resolved(self) -> Resolved:
        if self._options is None:
            self._options = resolve(
                self.app, self.name, retry=self.retry, ttl=self._ttl, store_url=self._store_url
            )
            if self.dead_letters is not None:
                with self._options.store.transaction() as tx:
                    deadletters.ensure_table(tx.connection, self.dead_letters)
        return self._options

    def _report(
        self,
        batch: _Batch,
        status: BatchStatus,
        attempts: int,
        written: int = 0,
        lost: int = 0,
        poison: int = 0,
    ) -> BatchReport:
        return BatchReport(
            self.name, batch.batch_id, batch.run_id, status, attempts, written, lost, poison
        )


def foreach_batch(app: Any, **options: Any) -> Callable[[BatchFunction], BatchWriter]:
    """Decorate ``fn(df, batch_id, tx)`` into a ``foreachBatch`` function; see `BatchWriter`.

    Options (validated here, at decoration time): ``name`` (the fence name and
    token namespace), ``token`` (the token column), ``retry``, ``fatal``,
    ``retry_on``, ``dead_letters`` (table name), ``validate``, ``schema`` (of
    the validated rows), ``on_retries_spent`` (``"fail"`` or
    ``"dead_letter"``), ``checkpoint_location``, ``ttl``, ``store_url``.
    """

    def decorate(func: BatchFunction) -> BatchWriter:
        return BatchWriter(func, app, **options)

    return decorate


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _text(option: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{option}={value!r} is not allowed; expected a non-empty string")
    return value


def _ddl(schema: object) -> str:
    if not isinstance(schema, str):
        raise ConfigurationError(
            f"schema={schema!r} is not allowed; expected a StructType or DDL string"
        )
    return schema
