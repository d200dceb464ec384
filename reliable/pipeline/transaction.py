"""The claim → handler → commit step of single and batch mode.

Single mode: one transaction per message, retried whole in process. Batch
mode: one transaction for the chunk, the claim and the handler together; if
that fails it is rolled back and each message runs again in its own savepoint
of a second transaction, so a poison message does not roll back its
neighbours. The transaction is the runner's (`reliable.pipeline.runner`):
the store's sync one for sync handlers, its async one for ``async def``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog

from backends.errors import BackendRefusedError, StoreUnavailableError
from backends.types import Message
from reliable.outcome import Outcome, Result
from reliable.pipeline.steps import Steps, Work, store_down, undecided

log = structlog.get_logger("reliable.pipeline")


async def each_in_transaction(steps: Steps, work: list[Work]) -> None:
    """Single mode: claim, call and commit each message in a transaction of its own."""
    for w in undecided(work):
        try:
            claimed, value = await steps.retrying([w.message], partial(_one, steps, w.message, w.token))
        except BackendRefusedError:  # the settings are wrong, not the message: it is not dead-lettered
            raise
        except Exception as exc:
            down = store_down(exc)
            w.result = steps.deferred(w.message, w.token, exc) if down else steps.failed(w.message, w.token, exc)
        else:
            w.decide(Outcome.PROCESSED if claimed else Outcome.DUPLICATE, value=value)


async def _one(steps: Steps, message: Message, token: str | None) -> tuple[bool, object]:
    async with steps.runner.transaction() as tx:
        if token is not None and not await steps.claim(tx, [token]):
            return False, None
        value = await steps.call([message], tx)
        await steps.save_offsets(tx, [message])
    steps.offsets_saved([message])
    return True, value


async def together_in_transaction(steps: Steps, work: list[Work]) -> None:
    """Batch mode: claim, call and commit the chunk in one transaction; if the claim or the
    handler fails, roll that transaction back and run each message again in a savepoint of a
    second one, so a poison message does not roll back its neighbours."""
    fresh = undecided(work)
    if not fresh:
        return
    try:
        try:
            done = await _in_transaction(steps, fresh, _together)
        except _BatchFailed as failed:
            log.info("batch_isolating_failure", handler=steps.handler.name, size=len(fresh),
                     error=str(failed.__cause__))
            done = await _in_transaction(steps, fresh, _one_by_one)
    except StoreUnavailableError as exc:
        for w in fresh:
            w.result = steps.deferred(w.message, w.token, exc)
        return
    steps.offsets_saved(done)


class _BatchFailed(Exception):
    """The claim or the handler of a whole batch raised: its transaction is rolled back."""


Run = Callable[[Steps, Any, list[Work]], Awaitable[None]]


async def _in_transaction(steps: Steps, fresh: list[Work], run: Run) -> list[Message]:
    """``run`` the chunk in one transaction with the offsets of the messages it decided done."""
    async with steps.runner.transaction() as tx:
        await run(steps, tx, fresh)
        done = [w.message for w in fresh if w.result is not None and w.result.acked]
        await steps.save_offsets(tx, done)
    return done


async def _together(steps: Steps, tx: Any, fresh: list[Work]) -> None:
    try:
        claimed = await steps.claim(tx, [w.token for w in fresh if w.token is not None])
        run = [w.message for w in fresh if w.token is None or w.token in claimed]
        if run:
            await steps.call(run, tx, batch=True)
    except BackendRefusedError:
        raise
    except Exception as exc:
        if store_down(exc):
            raise StoreUnavailableError(f"store unavailable in batch transaction: {exc}") from exc
        raise _BatchFailed from exc
    for w in fresh:
        w.decide(Outcome.PROCESSED if w.token is None or w.token in claimed else Outcome.DUPLICATE)


async def _one_by_one(steps: Steps, tx: Any, fresh: list[Work]) -> None:
    for w in fresh:
        w.result = await _isolated(steps, tx, w)


async def _isolated(steps: Steps, tx: Any, w: Work) -> Result:
    async def attempt() -> bool:
        async with steps.runner.savepoint(tx):
            if w.token is not None and not await steps.claim(tx, [w.token]):
                return False
            await steps.call([w.message], tx, batch=True)
            return True

    try:
        processed = await steps.retrying([w.message], attempt)
    except BackendRefusedError:
        raise
    except Exception as exc:
        if store_down(exc):
            raise StoreUnavailableError(f"store unavailable in isolated savepoint: {exc}") from exc
        return steps.failed(w.message, w.token, exc)
    return Result(w.message, Outcome.PROCESSED if processed else Outcome.DUPLICATE, w.token)
