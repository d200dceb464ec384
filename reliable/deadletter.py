"""Dead letters: inspect, replay and purge the messages a group could never process.

The record itself (`backends.types.DeadLetter`: the original message with its
bytes unchanged, the token and the `Failure`) is written by the pipeline in
the store: that table is the one place a framework user looks for dead
letters (``reliable dlq``, `App.dead_letters`), whatever the transport. A
transport's own ``%DLQ%<group>`` mirrors it for the engine's operators where
the transport keeps one, except the project's broker (``embedded://``,
``reliable://``): its ``%DLQ%`` and ``reliable broker dlq`` are for programs
that use the broker directly, and the framework writes no copy there, so
nothing it dead-letters can be replayed twice by accident.
Replaying sends the original message back to its group only (the
transport's ``publish_to_group``: ``%RETRY%<group>``, the group's own queue,
or a retry topic; never every group of the topic) with the replay count in a
header (its token was never claimed, since the failed
transaction rolled back, so the replay runs the handler again); a message replayed ``max_replays`` times is
refused (`ReplayLoopError`) unless forced, so a poison message cannot loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import structlog

from backends.store.base import Store
from backends.transport.base import ORIGIN_TOPIC_HEADER, Transport, origin_topic
from backends.types import DeadLetter, OutgoingMessage
from reliable.errors import DeadLetterNotFoundError, ReplayLoopError
from reliable.message import REPLAYS_HEADER
from reliable.middleware import Middlewares

log = structlog.get_logger("reliable.deadletter")
CHUNK = 100
"""Letters published (or deleted) per step: a crash replays at most this many twice."""
Progress = Callable[[int], object]
"""Told how many more letters are done, after each chunk (a progress bar's ``advance``)."""


class DeadLetters:
    """The dead-letter queue of the store, with replay through the transport."""

    def __init__(self, store: Store, transport: Transport, middleware: Middlewares | None = None) -> None:
        self.store = store
        self.transport = transport
        self.middleware = middleware or Middlewares()

    def page(self, group: str, limit: int = 100, after_id: int = 0) -> list[DeadLetter]:
        """Up to ``limit`` dead letters of ``group`` with id > ``after_id``, oldest first."""
        return self.store.dead_letters(group, limit=limit, after_id=after_id)

    def get(self, letter_id: int) -> DeadLetter | None:
        return self.store.get_dead_letter(letter_id)

    def count(self, group: str) -> int:
        return self.store.count_dead_letters(group)

    def replay(self, group: str, ids: Sequence[int] | None = None, *, max_replays: int = 3, force: bool = False,
               progress: Progress | None = None) -> int:
        """Publish the chosen dead letters (all of ``group`` by default) back; return how many.

        Letters go in chunks of `CHUNK`: each chunk is published to the group,
        then deleted, then counted to ``progress``; one summary line is logged.
        Each publish runs the app's ``before_publish`` / ``after_publish`` hooks
        (`Publish.replay` set), whose headers are added to the letters' own.
        """
        letters = self._select(group, ids)
        looping = [letter for letter in letters if letter.replays >= max_replays]
        if looping and not force:
            raise ReplayLoopError(
                f"dead letters {', '.join(str(letter.id) for letter in looping)} of group {group!r} were replayed "
                f"{max_replays} times already; fix the cause, or replay with force"
            )
        for start in range(0, len(letters), CHUNK):
            chunk = letters[start:start + CHUNK]
            for topic, messages in _by_origin_topic(chunk).items():
                self._publish(group, topic, messages)
            self.store.delete_dead_letters([letter.id for letter in chunk if letter.id is not None])
            if progress is not None:
                progress(len(chunk))
        log.info("dead_letters_replayed", group=group, count=len(letters))
        return len(letters)

    def _publish(self, group: str, topic: str, messages: list[OutgoingMessage]) -> None:
        with self.middleware.publishing(topic, None, len(messages), replayed=[m.headers for m in messages]) as added:
            if added:
                messages = [replace(m, headers={**m.headers, **added}) for m in messages]
            self.transport.publish_to_group(group, topic, messages)

    def purge(self, group: str, ids: Sequence[int] | None = None, *, progress: Progress | None = None) -> int:
        """Delete the chosen dead letters (all of ``group`` by default) in chunks; return how many."""
        letters = self._select(group, ids)
        deleted = 0
        for start in range(0, len(letters), CHUNK):
            chunk = letters[start:start + CHUNK]
            deleted += self.store.delete_dead_letters([letter.id for letter in chunk if letter.id is not None])
            if progress is not None:
                progress(len(chunk))
        log.info("dead_letters_purged", group=group, count=deleted)
        return deleted

    def _select(self, group: str, ids: Sequence[int] | None) -> list[DeadLetter]:
        if ids is None:
            return list(self.store.iter_dead_letters(group))
        letters = []
        for letter_id in ids:
            letter = self.store.get_dead_letter(letter_id)
            if letter is None or letter.group != group:
                raise DeadLetterNotFoundError(f"no dead letter {letter_id} in group {group!r}")
            letters.append(letter)
        return letters



def _by_origin_topic(letters: Sequence[DeadLetter]) -> dict[str, list[OutgoingMessage]]:
    """The letters' original messages, each with its replay count, by the topic they came from."""
    by_topic: dict[str, list[OutgoingMessage]] = {}
    for letter in letters:
        m = letter.message
        headers = {k: v for k, v in m.headers.items() if k != ORIGIN_TOPIC_HEADER}
        headers[REPLAYS_HEADER] = str(letter.replays + 1)
        outgoing = OutgoingMessage(m.payload, key=m.key, headers=headers, message_id=m.id)
        by_topic.setdefault(origin_topic(m), []).append(outgoing)
    return by_topic
