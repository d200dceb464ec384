"""Executor-side token checks: which tokens of a batch are new, asked in bulk.

Runs inside Spark's Python workers. Each worker process opens the store (and a
shared cache) by URL once and keeps it for the tasks it runs afterwards. The
check is read-only: nothing is recorded here. The driver claims the surviving
tokens in the batch transaction, which is the only place a token becomes
known, so a crash between this check and that commit loses nothing and
records nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from backends.cache.base import Cache
from backends.clock import SYSTEM_CLOCK, SystemClock
from backends.errors import CacheUnavailableError
from backends.store.base import Store

log = structlog.get_logger("reliable.spark")

SHARED_CACHE_SCHEMES = ("redis", "rediss")
"""Caches worth asking from an executor: a per-process memory cache never holds the driver's tokens."""


class AsOfClock(SystemClock):
    """The system clock, except that ``time()`` is the batch's start time on the driver.

    Executors judge token expiry exactly as the driver's clock does, even when
    the driver runs on a fake clock in tests.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now


_STORES: dict[str, tuple[Store, AsOfClock]] = {}
_CACHES: dict[str, Cache | None] = {}


def executor_store(url: str, as_of: float) -> Store:
    """This worker process's store for ``url``, its clock set to ``as_of``."""
    entry = _STORES.get(url)
    if entry is None:
        from backends.store import open_store

        clock = AsOfClock()
        entry = _STORES[url] = (open_store(url, clock), clock)
    entry[1].now = as_of
    return entry[0]


def executor_cache(url: str | None) -> Cache | None:
    """This worker process's cache for ``url``; None when there is none worth asking."""
    if not url or urlsplit(url).scheme not in SHARED_CACHE_SCHEMES:
        return None
    if url not in _CACHES:
        from backends.cache import open_cache

        _CACHES[url] = open_cache(url, SYSTEM_CLOCK)
    return _CACHES[url]


@dataclass(frozen=True)
class KnownTokens:
    """Asks the cache, then the store, which tokens of ``namespace`` are already recorded."""

    store_url: str
    namespace: str
    as_of: float
    cache_url: str | None = None

    def new(self, tokens: Sequence[str]) -> set[str]:
        """The tokens (distinct) that neither the cache nor the store knows."""
        remaining = list(tokens)
        cache = executor_cache(self.cache_url)
        if cache is not None and remaining:
            try:
                seen = cache.seen(self.namespace, remaining)
            except CacheUnavailableError as exc:  # degrade to the store alone
                log.warning("spark.cache.unavailable", namespace=self.namespace, error=str(exc))
                seen = set()
            remaining = [token for token in remaining if token not in seen]
        if not remaining:
            return set()
        known = executor_store(self.store_url, self.as_of).known(self.namespace, remaining)
        return {token for token in remaining if token not in known}
