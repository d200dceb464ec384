"""`MemoryCache`: an in-process LRU of tokens with a time to live (the embedded default)."""

from __future__ import annotations

import heapq
import math
import sys
import threading
from collections import OrderedDict

from backends.cache.base import Cache
from backends.clock import SYSTEM_CLOCK, Clock

DEFAULT_MAX_ENTRIES = 100_000
SWEEP_STEP = 64
"""Expired entries a call drops beyond one per token it names: the sweep outpaces the tokens
remembered, and no call holds the lock through a whole burst of expiries."""
BUCKET_SECONDS = 1.0
"""The span of expiry times one bucket holds: an entry is dropped once its bucket's span is past."""

Key = tuple[str, str]


def bucket_of(expires_at: float) -> int:
    """The number of the bucket of an entry expiring at ``expires_at`` (never: one never past)."""
    return math.floor(expires_at / BUCKET_SECONDS) if expires_at < math.inf else sys.maxsize


class MemoryCache(Cache):
    """Thread-safe LRU: the least recently seen or remembered token is evicted first.

    Expiry is read from the injected clock, so a `FakeClock` drives it in tests.
    Expired entries are also dropped unread: each entry sits in the bucket of
    its expiry second, and every call empties a few entries of the buckets
    past, earliest first (many short-lived tokens no longer fill the cache up
    to ``max_entries`` with dead ones).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, clock: Clock = SYSTEM_CLOCK) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._clock = clock
        self._expiry: OrderedDict[Key, float] = OrderedDict()
        self._buckets: dict[int, set[Key]] = {}  # every entry, by its bucket (expiry second)
        self._order: list[int] = []  # a heap of the buckets' numbers, each once
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

    def _seen(self, namespace: str, tokens: list[str]) -> set[str]:
        now = self._clock.monotonic()
        found: set[str] = set()
        with self._lock:
            self._sweep(now, len(tokens) + SWEEP_STEP)
            for token in tokens:
                key = (namespace, token)
                expires_at = self._expiry.get(key)
                if expires_at is None:
                    continue
                if expires_at <= now:
                    self._unfile(key, self._expiry.pop(key))
                    continue
                self._expiry.move_to_end(key)
                found.add(token)
        return found

    def _remember(self, namespace: str, tokens: list[str], ttl: float) -> None:
        now = self._clock.monotonic()
        expires_at = now + ttl
        number = bucket_of(expires_at)
        with self._lock:
            self._sweep(now, len(tokens) + SWEEP_STEP)
            expiry, bucket = self._expiry, self._buckets.get(number)
            if bucket is None:
                bucket = self._buckets[number] = set()
                heapq.heappush(self._order, number)
            for token in tokens:
                key = (namespace, token)
                before = expiry.pop(key, None)  # then set again: the most recent
                if before is not None:
                    self._unfile(key, before)
                expiry[key] = expires_at
                bucket.add(key)
            while len(expiry) > self.max_entries:
                self._unfile(*expiry.popitem(last=False))

    def _forget(self, namespace: str, tokens: list[str]) -> None:
        with self._lock:
            for token in tokens:
                key = (namespace, token)
                expires_at = self._expiry.pop(key, None)
                if expires_at is not None:
                    self._unfile(key, expires_at)

    def _unfile(self, key: Key, expires_at: float) -> None:
        """Take ``key`` out of its bucket (an emptied set keeps its table until cleared)."""
        bucket = self._buckets[bucket_of(expires_at)]
        bucket.discard(key)
        if not bucket:
            bucket.clear()

    def _sweep(self, now: float, budget: int) -> None:
        """Drop up to ``budget`` entries of the buckets whose span is past (all expired)."""
        order, buckets, expiry = self._order, self._buckets, self._expiry
        while order and (order[0] + 1) * BUCKET_SECONDS <= now and budget > 0:
            bucket = buckets[order[0]]
            while bucket and budget > 0:
                del expiry[bucket.pop()]
                budget -= 1
            if bucket:
                return
            del buckets[heapq.heappop(order)]
            budget -= 1

    def close(self) -> None:
        with self._lock:
            self._expiry.clear()
            self._buckets.clear()
            self._order.clear()
