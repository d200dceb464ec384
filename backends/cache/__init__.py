"""Caches: fast "seen?" lookups of tokens with a time to live, chosen by URL.

``memory://`` (the embedded default; ``memory://?max_entries=100000``) or
``redis://`` / ``rediss://`` (redis-py; any redis-py URL option applies).
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from backends.cache.base import Cache
from backends.cache.memory import DEFAULT_MAX_ENTRIES, MemoryCache
from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import ConfigurationError, UnsupportedURLError
from backends.urls import redact
from backends.values import positive

ALLOWED_SCHEMES = ("memory", "redis", "rediss")

__all__ = ["ALLOWED_SCHEMES", "Cache", "MemoryCache", "open_cache"]


def open_cache(url: str, clock: Clock = SYSTEM_CLOCK, prefix: str = "reliable") -> Cache:
    """The cache for ``url`` (Redis keys start with ``prefix``); an unknown scheme raises
    `UnsupportedURLError`."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return MemoryCache(_max_entries(url), clock=clock)
    if scheme in ("redis", "rediss"):
        from backends.cache.redis import RedisCache  # redis-py is an optional dependency

        return RedisCache(url, prefix)
    raise UnsupportedURLError(
        f"cache URL {redact(url)!r} has scheme {scheme!r}; "
        f"allowed schemes: {', '.join(ALLOWED_SCHEMES)}"
    )


def _max_entries(url: str) -> int:
    options = parse_qs(urlsplit(url).query)
    unknown = set(options) - {"max_entries"}
    if unknown:
        raise ConfigurationError(
            f"cache URL {redact(url)!r}: unknown option(s) {', '.join(sorted(unknown))}; "
            "allowed: max_entries"
        )
    raw = options.get("max_entries", [str(DEFAULT_MAX_ENTRIES)])[-1]
    try:
        value = int(raw)
    except ValueError:
        value = 0
    return positive(f"cache URL {redact(url)!r}: max_entries", value, original=raw, integer=True)
