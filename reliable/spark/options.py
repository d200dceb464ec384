"""The wrapper's effective options: decorator arguments over the app's settings.

Resolved on the first batch, not at decoration time, so a module can decorate
its batch function before the app's backends are opened. Only ``app.store``,
``app.cache``, ``app.settings`` and ``app.clock`` are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.clock import Clock
from backends.errors import ConfigurationError
from reliable.retry import DelayLevels, RedeliveryPolicy

DEFAULT_TOKEN_TTL = 7 * 86_400.0


@dataclass(frozen=True)
class Resolved:
    """What a batch needs from the app."""

    store: Any
    cache: Any
    clock: Clock
    store_url: str
    cache_url: str | None
    retry: RedeliveryPolicy | DelayLevels | None
    token_ttl: float
    cache_ttl: float


def resolve(
    app: Any,
    name: str,
    *,
    retry: RedeliveryPolicy | DelayLevels | None,
    ttl: float | None,
    store_url: str | None,
) -> Resolved:
    """Options for wrapper ``name``: explicit ones first, then ``[handlers.<name>]`` settings."""
    settings = _for_handler(getattr(app, "settings", None), name)
    url = store_url or _get(settings, "store", "url")
    if not url:
        raise ConfigurationError(
            f"foreach_batch {name!r}: the executors need the store's URL; give store_url= or "
            "settings with [store] url"
        )
    token_ttl = (
        ttl if ttl is not None else _get(settings, "store", "token_ttl") or DEFAULT_TOKEN_TTL
    )
    if retry is None:
        policy = getattr(_get(settings, "retry"), "policy", None)
        retry = policy() if callable(policy) else None
    cache_url = _get(settings, "cache", "url")
    return Resolved(
        store=app.store,
        cache=getattr(app, "cache", None),
        clock=app.clock,
        store_url=str(url),
        cache_url=None if cache_url in (None, "none") else str(cache_url),
        retry=retry,
        token_ttl=float(token_ttl),
        cache_ttl=float(_get(settings, "cache", "ttl") or token_ttl),
    )


def _for_handler(settings: Any, name: str) -> Any:
    for_handler = getattr(settings, "for_handler", None)
    if callable(for_handler):
        try:
            return for_handler(name)
        except (KeyError, LookupError):
            return settings
    return settings


def _get(settings: Any, *path: str) -> Any:
    value = settings
    for part in path:
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
