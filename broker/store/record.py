"""What goes into the store (`Record`), what comes back (`StoredMessage`, `AppendResult`).

They are named tuples: immutable, and cheap to build by the hundred thousand.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class Record(NamedTuple):
    """A message to append to a topic queue.

    An empty ``message_id`` lets the store assign one (unique per store).
    ``attempt`` counts deliveries already tried (0 for a fresh message).
    """

    topic: str
    queue: int
    body: bytes
    key: str = ""
    tag: str = ""
    headers: Mapping[str, str] = NO_HEADERS
    message_id: str = ""
    attempt: int = 0


class StoredMessage(NamedTuple):
    """A record as the store keeps it: its place (topic, queue, offset) and log position."""

    topic: str
    queue: int
    queue_offset: int
    log_offset: int
    message_id: str
    key: str
    tag: str
    headers: Mapping[str, str]
    body: bytes
    store_time: float
    attempt: int


class AppendResult(NamedTuple):
    """Where an appended record landed; ``size`` is its framed size in the log."""

    topic: str
    queue: int
    queue_offset: int
    log_offset: int
    message_id: str
    size: int
