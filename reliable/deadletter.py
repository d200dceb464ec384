"""Dead letters: inspect, replay and purge the messages a group could never process.

The record itself (`backends.types.DeadLetter`: the original message with its
bytes unchanged, the token and the `Failure`) is written by the pipeline in
the store: that table is the one place a framework user looks for dead
letters (``reliable dlq``, `App.dead_letters`), whatever the transport; a
transport's own ``%DLQ%<group>`` mirrors it for the engine's operators.
Replaying sends the original message back to its group only (the
transport's ``publish_to_group``: ``%RETRY%<group>``, the group's own queue,
or a retry topic; never every group of the topic) with the replay count in a
header (its token was never claimed, since the failed
transaction rolled back, so the replay runs the handler again); a message replayed ``max_replays`` times is
refused (`ReplayLoopError`) unless forced, so a poison message cannot loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from backends.store.base import Store
from backends.transport.base import ORIGIN_TOPIC_HEADER, Transport, origin_topic
from backends.types import DeadLetter, OutgoingMessage
from reliable.errors import DeadLetterNotFoundError, ReplayLoopError
from reliable.message import REPLAYS_HEADER

log = structlog.get_logger("reliable.deadletter")


class DeadLetters:
    """The dead-letter queue of the store, with replay through the transport."""

    def __init__(self, store: Store, transport: Transport) -> None:
        self.store = store
        self.transport = transport

    def page(self, group: str, limit: int = 100, after_id: int = 0) -> list[DeadLetter]:
        """Up to ``limit`` dead letters of ``group`` with id > ``after_id``, oldest first."""
        return self.store.dead_letters(group, limit=limit, after_id=after_id)

    def get(self, letter_id: int) -> DeadLetter | None:
        return self.store.get_dead_letter(letter_id)

    def count(self, group: str) -> int:
        return self.store.count_dead_letters(group)

    def replay(self, group: str, ids: Sequence[int] | None = None, *, max_replays: int = 3, force: bool = False) -> int:
        """Publish the chosen dead letters (all of ``group`` by default) back; return how many."""
        letters = self._select(group, ids)
        looping = [letter for letter in letters if letter.replays >= max_replays]
        if looping and not force:
            raise ReplayLoopError(
                f"dead letters {', '.join(str(letter.id) for letter in looping)} of group {group!r} were replayed "
                f"{max_replays} times already; fix the cause, or replay with force"
            )
        for letter in letters:
            self._republish(letter)
            self.store.delete_dead_letters([letter.id] if letter.id is not None else [])
            log.info("dead_letter_replayed", group=group, id=letter.id, topic=letter.message.topic,
                     token=letter.token, replays=letter.replays + 1)
        return len(letters)

    def purge(self, group: str, ids: Sequence[int] | None = None) -> int:
        letters = self._select(group, ids)
        deleted = self.store.delete_dead_letters([letter.id for letter in letters if letter.id is not None])
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

    def _republish(self, letter: DeadLetter) -> None:
        m = letter.message
        headers = {k: v for k, v in m.headers.items() if k != ORIGIN_TOPIC_HEADER}
        headers[REPLAYS_HEADER] = str(letter.replays + 1)
        outgoing = OutgoingMessage(m.payload, key=m.key, headers=headers, message_id=m.id)
        self.transport.publish_to_group(letter.group, origin_topic(m), [outgoing])
