"""Executor-side cache check: which tokens of a batch the shared cache already knows.

Runs inside Spark's Python workers, and only when the app has a shared cache
(Redis): each worker process opens it by URL once and keeps it for the tasks
it runs afterwards. The check is a shortcut that spares known rows the
``validate`` step and the claim. It never decides on its own: the store is
not read here, because the claim on the driver (``INSERT ... ON CONFLICT ...
RETURNING``) both records the new tokens and reveals every known one in the
batch transaction, so a separate store read would only repeat it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from backends.cache.base import Cache
from backends.clock import SYSTEM_CLOCK
from backends.errors import CacheUnavailableError

log = structlog.get_logger("reliable.spark")

SHARED_CACHE_SCHEMES = ("redis", "rediss")
"""Caches worth asking from an executor: a per-process memory cache never holds the driver's tokens."""

_CACHES: dict[str, Cache] = {}


def shared_cache_url(url: str | None) -> str | None:
    """``url`` if executors can share it (Redis), else None."""
    return url if url and urlsplit(url).scheme in SHARED_CACHE_SCHEMES else None


def executor_cache(url: str) -> Cache:
    """This worker process's cache for ``url``."""
    if url not in _CACHES:
        from backends.cache import open_cache

        _CACHES[url] = open_cache(url, SYSTEM_CLOCK)
    return _CACHES[url]


@dataclass(frozen=True)
class CachedTokens:
    """Asks the shared cache, in bulk, which tokens of ``namespace`` are already recorded."""

    cache_url: str
    namespace: str

    def new(self, tokens: Sequence[str]) -> set[str]:
        """The tokens the cache does not know (all of them when the cache is down)."""
        try:
            seen = executor_cache(self.cache_url).seen(self.namespace, tokens)
        except CacheUnavailableError as exc:  # degrade: the claim still finds every known token
            log.warning("spark.cache.unavailable", namespace=self.namespace, error=str(exc))
            return set(tokens)
        return {token for token in tokens if token not in seen}
