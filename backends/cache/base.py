"""The `Cache` protocol: fast "seen?" lookups of tokens, with a time to live."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Cache(ABC):
    """Remembers which tokens a namespace (a group) has already processed.

    Public operations are written once here; a backend implements the
    private primitives. Any connection failure is raised as
    `CacheUnavailableError` (the pipeline then degrades to the store).
    """

    def seen(self, namespace: str, tokens: Sequence[str]) -> set[str]:
        """The subset of ``tokens`` known to the cache, in one round trip."""
        if not tokens:
            return set()
        return self._seen(namespace, list(dict.fromkeys(tokens)))

    def remember(self, namespace: str, tokens: Sequence[str], ttl: float) -> None:
        """Record ``tokens`` as processed for ``ttl`` seconds, in one round trip."""
        if tokens:
            self._remember(namespace, list(dict.fromkeys(tokens)), ttl)

    def forget(self, namespace: str, tokens: Sequence[str]) -> None:
        """Drop ``tokens`` (used when a dead letter is replayed)."""
        if tokens:
            self._forget(namespace, list(tokens))

    def close(self) -> None:
        """Release connections."""

    @abstractmethod
    def _seen(self, namespace: str, tokens: list[str]) -> set[str]: ...

    @abstractmethod
    def _remember(self, namespace: str, tokens: list[str], ttl: float) -> None: ...

    @abstractmethod
    def _forget(self, namespace: str, tokens: list[str]) -> None: ...
