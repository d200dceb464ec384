"""Topics and their queue counts, and which queue a published message goes to."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path

from broker.delivery.group import DLQ_PREFIX, RETRY_PREFIX
from broker.delivery.selection import QueueSelector, RoundRobin
from broker.delivery.topicfile import TopicFile
from broker.errors import InvalidNameError, TooManyTopicsError
from broker.store.queues import TOPIC_NAME

MAX_NAME = 200


def check_name(kind: str, name: str, *, internal: bool = False) -> None:
    """An `InvalidNameError` unless ``name`` is a usable topic or group name.

    Both follow the store's rule for topic names (`broker.store.queues.TOPIC_NAME`):
    a group's name becomes part of its ``%RETRY%`` and ``%DLQ%`` topics, so it is
    refused here, before anything (``topics.json``, a consume queue) is written.
    """
    longest = MAX_NAME - (len(RETRY_PREFIX) if kind == "group" else 0)
    if (not isinstance(name, str) or len(name) > longest or not TOPIC_NAME.fullmatch(name)
            or name in (".", "..")):
        raise InvalidNameError(
            f"{kind} name {name!r}: expected 1 to {longest} characters of letters, digits, "
            "'_', '.', '%' or '-', and not '.' or '..'")
    if not internal and name.startswith((RETRY_PREFIX, DLQ_PREFIX)):
        raise InvalidNameError(f"{kind} name {name!r}: names starting with %RETRY% or %DLQ% are the broker's")


class Topics:
    """The topic table (``topics.json`` and its log, `broker.delivery.topicfile`): a topic is
    created on first use with the default queue count."""

    def __init__(self, path: Path, default_queues: int, selector: QueueSelector | None = None,
                 max_topics: int = 10_000) -> None:
        self.path = path
        self.default_queues = default_queues
        self.selector = selector or RoundRobin()
        self.max_topics = max_topics
        self._file = TopicFile(path)
        self._queues = self._file.table
        self._named = sum(not _internal(topic) for topic in self._queues)  # what max_topics counts

    def queues(self, topic: str) -> int:
        """The queue count of ``topic``, creating it (internal topics get one queue)."""
        count = self._queues.get(topic)
        if count is None:
            check_name("topic", topic, internal=True)  # also %RETRY%/%DLQ% of a group's name
            internal = _internal(topic)
            if not internal and self._named >= self.max_topics:
                raise TooManyTopicsError(
                    f"topic {topic!r}: the broker holds max_topics={self.max_topics} topics, so a new "
                    "topic cannot be made (the topics there still take messages); raise max_topics")
            count = 1 if internal else self.default_queues
            self._file.add(topic, count)
            self._named += not internal
        return count

    def exists(self, topic: str) -> bool:
        return topic in self._queues

    def held(self, topic: str) -> int:
        """The queue count of ``topic``, 0 if the broker does not hold it (a read does not make it)."""
        return self._queues.get(topic, 0)

    def known(self) -> dict[str, int]:
        return dict(self._queues)

    def select(self, topic: str, key: str, queue: int | None) -> int:
        """The queue of a message: the one asked for, else by key hash (order per key), else
        the selector's (round robin, or latency-aware: see `broker.delivery.selection`)."""
        count = self.queues(topic)
        if queue is not None:
            if not 0 <= queue < count:
                raise InvalidNameError(f"topic {topic!r} has queues 0..{count - 1}, not {queue}")
            return queue
        if key:
            return zlib.crc32(key.encode()) % count
        return self.selector.spread(topic, count, 1)[0]

    def select_many(self, topic: str, keys: Sequence[str], asked: Sequence[int | None]) -> list[int]:
        """`select` for a batch; a batch without keys or queues asked for is spread at once."""
        if any(keys) or asked.count(None) != len(asked):
            return list(map(self.select, repeat(topic), keys, asked))
        return self.selector.spread(topic, self.queues(topic), len(keys))


def _internal(topic: str) -> bool:
    """A group's own topic (``%RETRY%``, ``%DLQ%``): ``max_groups`` bounds those."""
    return topic.startswith((RETRY_PREFIX, DLQ_PREFIX))
