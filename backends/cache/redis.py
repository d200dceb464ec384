"""`RedisCache`: tokens as Redis keys ``reliable:{namespace}:{token}`` with an expiry.

``seen`` is one MGET and ``remember`` one server-side script running
``SET ... PX`` per key, whatever the number of tokens (one command to encode
and one reply to parse, where a pipeline would cost both per token). Redis keeps the time itself, so the injected clock is
not used here. Every Redis failure is raised as `CacheUnavailableError`: the
pipeline then degrades to the store, which stays the source of truth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis
import structlog

from backends.cache.base import Cache
from backends.errors import CacheUnavailableError
from backends.refusal import FirstContact
from backends.urls import redact

log = structlog.get_logger(__name__)

KEY_PREFIX = "reliable"
# A cache lookup must never stall a consumer: fail fast and fall back to the store.
DEFAULT_TIMEOUT = 2.0

R = TypeVar("R")

_REMEMBER = """
for _, key in ipairs(KEYS) do redis.call('SET', key, '1', 'PX', ARGV[1]) end
return #KEYS
"""


class RedisCache(Cache):
    """The `Cache` on Redis (``redis://`` or ``rediss://`` for TLS)."""

    def __init__(self, url: str, prefix: str = KEY_PREFIX) -> None:
        self.url = url
        self.prefix = prefix  # two deployments sharing one Redis keep apart by their prefixes
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=DEFAULT_TIMEOUT,
            socket_connect_timeout=DEFAULT_TIMEOUT,
            health_check_interval=30,
        )
        self._remember_script = self._client.register_script(_REMEMBER)
        self._contact = FirstContact("[cache] url", redact(url))

    def __repr__(self) -> str:
        options = self._client.connection_pool.connection_kwargs
        where = options.get("path") or f"{options.get('host', '?')}:{options.get('port', '?')}"
        return f"RedisCache('{where}/{options.get('db', 0)}')"

    def key(self, namespace: str, token: str) -> str:
        """The Redis key holding ``token`` of ``namespace``."""
        return f"{self.prefix}:{namespace}:{token}"

    def _seen(self, namespace: str, tokens: list[str]) -> set[str]:
        start = self.key(namespace, "")
        values = self._call("seen", lambda: self._client.mget([start + token for token in tokens]))
        return {token for token, value in zip(tokens, values, strict=True) if value is not None}

    def _remember(self, namespace: str, tokens: list[str], ttl: float) -> None:
        milliseconds = max(1, round(ttl * 1000))
        start = self.key(namespace, "")
        keys = [start + token for token in tokens]
        self._call("remember", lambda: self._remember_script(keys=keys, args=[milliseconds]))

    def _forget(self, namespace: str, tokens: list[str]) -> None:
        keys = [self.key(namespace, token) for token in tokens]
        self._call("forget", lambda: self._client.delete(*keys))

    def _call(self, operation: str, send: Callable[[], R]) -> R:
        try:
            done = send()
        except redis.AuthenticationError as exc:  # WRONGPASS, NOAUTH: the URL's login
            raise self._contact.refused(f"Redis: {exc}", CacheUnavailableError) from exc
        except redis.RedisError as exc:
            log.warning("cache.unavailable", cache=repr(self), operation=operation, error=str(exc))
            raise CacheUnavailableError(f"{self!r} failed during {operation}: {exc}") from exc
        self._contact.accepted()
        return done

    def close(self) -> None:
        self._client.close()
