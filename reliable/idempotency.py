"""Idempotency: a token per message, checked in the cache, then claimed in the store.

`Token` turns a message into its token. `Guard` does the checks of the
pipeline in bulk: the cache (one round trip), then the claim under the unique
index inside the handler's transaction (one statement for a whole batch,
which records the new tokens and reveals the known ones), then the cache fill
(written behind). A cache that is down degrades to the store alone.
"""

from __future__ import annotations

import difflib
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from backends.cache.base import Cache
from backends.errors import CacheUnavailableError
from backends.store.base import Transaction
from backends.store.schema import TOKEN_MAX
from backends.types import Message, not_text, readable
from reliable.errors import HandlerOptionError, TokenInvalidError, TokenMissingError

log = structlog.get_logger("reliable.idempotency")

TokenFunction = Callable[[Message], Any]


class Token:
    """Extracts a message's token; ``a | b`` falls back to ``b`` when ``a`` finds none.

    Specs: ``"id"`` (the message id), ``"key"`` (the message key),
    ``"header.NAME"``, ``"body.a.b"`` (a field path in the decoded body), or
    any callable taking the message.
    """

    def __init__(self, extract: TokenFunction, describe: str,
                 explain: Callable[[Message], str] | None = None) -> None:
        self._extract = extract
        self.describe = describe
        self._explain = explain  # why a message has no token here (a body path: where it stopped)

    @classmethod
    def parse(cls, spec: str | TokenFunction | Token) -> Token:
        if isinstance(spec, Token):
            return spec
        if callable(spec):
            return cls(spec, getattr(spec, "__name__", repr(spec)))
        if not isinstance(spec, str):
            raise HandlerOptionError(f"token={spec!r} is not allowed; expected {_ALLOWED}")
        if spec == "id":
            return cls(lambda m: m.id, spec)
        if spec == "key":
            return cls(lambda m: m.key, spec)
        source, _, path = spec.partition(".")
        if source in ("header", "headers") and path:
            return cls(lambda m: m.headers.get(path), spec)
        if source == "body" and path:
            parts = path.split(".")
            return cls(_body_path(parts), spec, lambda m: _where_missing(parts, m.body))
        raise HandlerOptionError(f"token={spec!r} is not allowed; expected {_ALLOWED}")

    def __or__(self, other: str | TokenFunction | Token) -> Token:
        fallback = Token.parse(other)
        return Token(lambda m: self._find(m) or fallback._find(m), f"{self.describe} | {fallback.describe}")

    def _find(self, message: Message) -> str | None:
        value = self._extract(message)
        return None if value is None or value == "" else str(value)

    def __call__(self, message: Message) -> str:
        """The token, or `TokenMissingError` naming where it was looked for, or
        `TokenInvalidError` when the store could not record it (`unrecordable`)."""
        token = self._find(message)
        if token is None:
            why = f": {self._explain(message)}" if self._explain is not None else ""
            raise TokenMissingError(f"message {message.id} has no token at {self.describe}{why}")
        if problem := unrecordable(token):
            raise TokenInvalidError(f"message {message.id}: the token at {self.describe} {problem}")
        return token


def unrecordable(token: str) -> str | None:
    """Why the store could not record ``token``, or None: PostgreSQL refuses a token wider than
    its column or holding a NUL character, and would refuse its dead-letter record too; no store
    records bytes that are not UTF-8 (a binary Kafka key: `backends.types.text_from_bytes`)."""
    if len(token) > TOKEN_MAX:
        return f"is {len(token)} characters long; at most {TOKEN_MAX} are recorded"
    if "\x00" in token:
        return f"holds a NUL character ('{readable(token)}')"
    if not_text(token):
        return (f"holds bytes that are not UTF-8 ('{readable(token)}'); tokens are recorded as text: "
                "take the token from elsewhere, or from a function that returns text")
    return None


_ALLOWED = "'id', 'key', 'header.NAME', 'body.PATH' or a callable(message) -> str"


def _body_path(parts: list[str]) -> TokenFunction:
    def extract(message: Message) -> Any:
        value = message.body
        for part in parts:
            if isinstance(value, dict):
                value = value.get(part)
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                return None
        return value

    return extract


def _where_missing(parts: list[str], body: Any) -> str:
    """Where the body path ``parts`` found no token: the field that is missing or empty, with the
    fields that are there (a misspelt path dead-letters every message: say which field was meant)."""
    value, here = body, "the body"
    for part in parts:
        if isinstance(value, dict):
            if value.get(part) in (None, "") and part in value:
                return f"{here}'s field {part!r} is {value[part]!r}"
            if part not in value:
                fields = sorted(str(f) for f in value)
                lowered = {f.lower(): f for f in fields}
                guess = [lowered[g] for g in difflib.get_close_matches(part.lower(), list(lowered), n=1)]
                shown = ", ".join(repr(f) for f in fields[:MAX_FIELDS_SHOWN])
                shown += ", ..." if len(fields) > MAX_FIELDS_SHOWN else ""
                return (f"{here} has no field {part!r} (it has {shown or 'no fields'})"
                        + (f"; did you mean {guess[0]!r}?" if guess else ""))
            value = value[part]
        elif isinstance(value, list):
            if not (part.isdigit() and int(part) < len(value)):
                return f"{here} is a list of {len(value)}, with no item {part!r}"
            value = value[int(part)]
        else:
            return f"{here} is {type(value).__name__}, not an object with a field {part!r}"
        here = f"{'body' if here == 'the body' else here}.{part}"
    return f"{here} is {value!r}"


MAX_FIELDS_SHOWN = 20
"""Fields named in a `TokenMissingError` at most (a body is any producer's)."""


class CacheFiller:
    """Writes committed tokens to the cache behind the pipeline, on a background thread.

    Tokens are queued; once `fill_batch` are queued they are sent in one call
    while the pipeline goes on with the next messages. A duplicate that arrives
    before its token reaches the cache is still caught by the store's claim:
    the cache is only ever a shortcut.
    """

    def __init__(self, fill: Callable[[list[str]], None], fill_batch: int = 256) -> None:
        self._fill = fill
        self._fill_batch = fill_batch
        self._unfilled: list[str] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue[list[str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def add(self, tokens: Collection[str]) -> None:
        with self._lock:
            self._unfilled.extend(tokens)
            if len(self._unfilled) < self._fill_batch:
                return
            batch, self._unfilled = self._unfilled, []
        self._send(batch)

    def flush(self) -> None:
        """Send what is queued and wait until the cache has it all (idle, shutdown)."""
        with self._lock:
            batch, self._unfilled = self._unfilled, []
        if batch:
            self._send(batch)
        self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def _send(self, batch: list[str]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="reliable-cache-fill", daemon=True)
            self._thread.start()
        self._queue.put(batch)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                self._fill(batch)
            finally:
                self._queue.task_done()
        self._queue.task_done()


@dataclass
class Guard:
    """The cache and store checks of one group's tokens (cache fills are written behind)."""

    namespace: str
    cache: Cache | None
    cache_ttl: float
    token_ttl: float
    on_cache_down: Callable[[], None] = lambda: None
    fill_batch: int = 256  # tokens queued before a fill is sent (see `CacheFiller`)
    filler: CacheFiller = field(init=False)

    def __post_init__(self) -> None:
        self.filler = CacheFiller(self._fill, self.fill_batch)

    def cached(self, tokens: Sequence[str]) -> set[str]:
        """Tokens the cache has seen; an empty set when the cache is down (logged)."""
        if self.cache is None or not tokens:
            return set()
        try:
            return self.cache.seen(self.namespace, tokens)
        except CacheUnavailableError as exc:
            self._cache_down("seen", exc)
            return set()

    def claim(self, tx: Transaction, tokens: Sequence[str]) -> set[str]:
        """Claim ``tokens`` in ``tx``; the ones not returned are duplicates."""
        return tx.claim(self.namespace, tokens, self.token_ttl) if tokens else set()

    def remember(self, tokens: Collection[str]) -> None:
        """Queue committed tokens for the cache (written behind, see `CacheFiller`)."""
        if self.cache is not None and tokens:
            self.filler.add(tokens)

    def flush(self) -> None:
        """Wait until every committed token is in the cache."""
        self.filler.flush()

    def close(self) -> None:
        self.filler.close()

    def _fill(self, tokens: list[str]) -> None:
        if self.cache is None or not tokens:
            return
        try:
            self.cache.remember(self.namespace, tokens, self.cache_ttl)
        except CacheUnavailableError as exc:  # costs a later store lookup, nothing more
            self._cache_down("remember", exc)

    def _cache_down(self, operation: str, exc: Exception) -> None:
        self.on_cache_down()
        log.warning("cache_degraded", namespace=self.namespace, operation=operation, error=str(exc))
