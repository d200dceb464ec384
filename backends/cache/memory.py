"""`MemoryCache`: an in-process LRU of tokens with a time to live (the embedded default)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from backends.cache.base import Cache
from backends.clock import SYSTEM_CLOCK, Clock

DEFAULT_MAX_ENTRIES = 100_000


class MemoryCache(Cache):
    """Thread-safe LRU: the least recently seen or remembered token is evicted first.

    Expiry is read from the injected clock, so a `FakeClock` drives it in tests.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, clock: Clock = SYSTEM_CLOCK) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._clock = clock
        self._expiry: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

    def _seen(self, namespace: str, tokens: list[str]) -> set[str]:
        now = self._clock.monotonic()
        found: set[str] = set()
        with self._lock:
            for token in tokens:
                key = (namespace, token)
                expires_at = self._expiry.get(key)
                if expires_at is None:
                    continue
                if expires_at <= now:
                    del self._expiry[key]
                    continue
                self._expiry.move_to_end(key)
                found.add(token)
        return found

    def _remember(self, namespace: str, tokens: list[str], ttl: float) -> None:
        expires_at = self._clock.monotonic() + ttl
        with self._lock:
            for token in tokens:
                key = (namespace, token)
                self._expiry[key] = expires_at
                self._expiry.move_to_end(key)
            while len(self._expiry) > self.max_entries:
                self._expiry.popitem(last=False)

    def _forget(self, namespace: str, tokens: list[str]) -> None:
        with self._lock:
            for token in tokens:
                self._expiry.pop((namespace, token), None)

    def close(self) -> None:
        with self._lock:
            self._expiry.clear()
