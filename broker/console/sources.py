"""What the console reads and changes, as two small protocols.

`BrokerView` is the operator half of the broker's API: a `broker.client.Client`
has it, and `EngineView` gives it to an engine in this process (the server's,
or an embedded directory's). `LetterBook` is a place of dead-letter records
kept by someone other than the broker: the framework's store, which the
``reliable`` package plugs in (the broker knows nothing of the framework).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.delivery import lookup
from broker.delivery.values import Delivery, GroupInfo, QueueLag, TopicInfo
from broker.errors import BrokerError


class BrokerView(Protocol):
    """The broker as an operator sees it."""

    def topics(self) -> list[TopicInfo]: ...
    def groups(self) -> list[GroupInfo]: ...
    def lag(self, group: str) -> list[QueueLag]: ...
    def dlq_list(self, group: str, limit: int = 100, *, body_limit: int | None = None) -> list[Delivery]: ...
    def dlq_waiting(self, group: str) -> int: ...
    def dlq_replay(self, group: str) -> int: ...
    def dlq_purge(self, group: str) -> int: ...
    def dlq_replay_letters(self, group: str, offsets: Sequence[int]) -> int: ...
    def dlq_purge_letters(self, group: str, offsets: Sequence[int]) -> int: ...
    def lookup_key(self, topic: str, key: str, begin: float, end: float, limit: int) -> list[Delivery]: ...
    def lookup_id(self, message_id: str) -> Delivery | None: ...


class EngineView:
    """`BrokerView` over an engine in this process (`broker.delivery.engine.Broker` or embedded)."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def topics(self) -> list[TopicInfo]:
        return list(self.api.topics())

    def groups(self) -> list[GroupInfo]:
        return list(self.api.groups())

    def lag(self, group: str) -> list[QueueLag]:
        return list(self.api.lag(group))

    def dlq_list(self, group: str, limit: int = 100, *, body_limit: int | None = None) -> list[Delivery]:
        return list(self.api.dlq_list(group, limit, body_limit=body_limit))

    def dlq_waiting(self, group: str) -> int:
        return lookup.dlq_waiting(self.api, group)

    def dlq_replay(self, group: str) -> int:
        return int(self.api.dlq_replay(group))

    def dlq_purge(self, group: str) -> int:
        return int(self.api.dlq_purge(group))

    def dlq_replay_letters(self, group: str, offsets: Sequence[int]) -> int:
        return int(self.api.dlq_replay_letters(group, offsets))

    def dlq_purge_letters(self, group: str, offsets: Sequence[int]) -> int:
        return int(self.api.dlq_purge_letters(group, offsets))

    def lookup_key(self, topic: str, key: str, begin: float, end: float, limit: int) -> list[Delivery]:
        return lookup.by_key(self._engine(), topic, key, begin, end, limit)

    def lookup_id(self, message_id: str) -> Delivery | None:
        return lookup.by_id(self._engine(), message_id)

    def _engine(self) -> Any:
        """The engine itself: lookups read its store (an embedded directory this process owns)."""
        owned = getattr(self.api, "owner", None)
        return self.api.engine if owned else self.api


def broker_view(api: Any) -> BrokerView:
    """The operator view of a broker API: a server client has every call, an engine needs `EngineView`."""
    return api if hasattr(api, "lookup_key") else EngineView(api)


class Backlog(Protocol):
    """Messages written but not yet published (the framework's outbox), as figures by name."""

    def status(self) -> dict[str, float | int | str | None]: ...


class Counters(Protocol):
    """Counters of the consumers (the framework's handlers), by source and name, outcome by outcome."""

    def table(self) -> list[tuple[str, str, dict[str, float]]]: ...


class ConsoleActionError(BrokerError):
    """Raised when a `LetterBook` refuses an action: a replay loop, a letter that is not there."""


@dataclass(frozen=True)
class Letter:
    """One dead-letter record as the console shows it, whoever keeps it."""

    id: int
    group: str
    topic: str
    message_id: str
    key: str
    headers: dict[str, str]
    body: bytes
    error_type: str
    error: str
    traceback: str
    attempts: int
    replays: int
    last_failure_at: float
    extra: dict[str, str] = field(default_factory=dict)
    body_size: int | None = None
    """The whole body's bytes when ``body`` holds only its first bytes (a listing's letters)."""


class LetterBook(Protocol):
    """Dead-letter records of groups, paged by id (keyset: no offset scan on a long list)."""

    def groups(self) -> list[str]: ...
    def count(self, group: str) -> int: ...
    def page(self, group: str, limit: int, after_id: int) -> list[Letter]: ...
    def get(self, letter_id: int) -> Letter | None: ...
    def replay(self, group: str, ids: Sequence[int], *, force: bool) -> int: ...
    def purge(self, group: str, ids: Sequence[int]) -> int: ...
