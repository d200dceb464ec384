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
A replay takes a chunk of letters in a short store transaction, marking them
held for a while (`HOLD`), sends them with no transaction open (on SQLite a
write transaction is the whole database's lock: handlers' commits waited
behind the transport), then deletes those the transport took. Operators
replaying and purging at once never send a letter twice or send a purged one
(another replay skips held letters, a purge leaves them to the replay), a
letter the transport refuses stays where it was (`ReplayRefusedError` names
it), and a replay killed mid-send leaves its chunk held until the hold runs
out, for the next replay to send again under the same message ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import structlog

from backends.errors import BackendUnavailableError, TransportError
from backends.store.base import Store
from backends.transport.base import ORIGIN_TOPIC_HEADER, Transport, origin_topic
from backends.types import DeadLetter, OutgoingMessage
from reliable.errors import DeadLetterNotFoundError, ReplayLoopError, ReplayRefusedError
from reliable.message import REPLAYS_HEADER
from reliable.middleware import Middlewares

log = structlog.get_logger("reliable.deadletter")
CHUNK = 20
"""Letters taken, sent and deleted at a time: a replay killed mid-send sends at most this many again
(20 costs two short store writes per 20 letters)."""
HOLD = 60.0
"""Seconds a replay holds the chunk it took while it sends it; a replay that died (kill -9, Ctrl-C
mid-send) lets go of its chunk when this runs out."""
PURGE_CHUNK = 100
"""Letters deleted per store transaction by a purge."""
Progress = Callable[[int], object]
"""Told how many more letters are done, after each chunk (a progress bar's ``advance``)."""


class DeadLetters:
    """The dead-letter queue of the store, with replay through the transport."""

    def __init__(self, store: Store, transport: Transport, middleware: Middlewares | None = None) -> None:
        self.store = store
        self.transport = transport
        self.middleware = middleware or Middlewares()

    def page(self, group: str, limit: int = 100, after_id: int = 0, *,
             body_limit: int | None = None) -> list[DeadLetter]:
        """Up to ``limit`` dead letters of ``group`` with id > ``after_id``, oldest first; with
        ``body_limit``, only the first bytes of each body (`Store.dead_letters`)."""
        return self.store.dead_letters(group, limit=limit, after_id=after_id, body_limit=body_limit)

    def get(self, letter_id: int) -> DeadLetter | None:
        return self.store.get_dead_letter(letter_id)

    def count(self, group: str) -> int:
        return self.store.count_dead_letters(group)

    def replay(self, group: str, ids: Sequence[int] | None = None, *, max_replays: int = 3, force: bool = False,
               progress: Progress | None = None, hold: float = HOLD) -> int:
        """Publish the chosen dead letters (all of ``group`` by default) back; return how many.

        The choice is made once, as ids: letters dead-lettered while the replay
        runs (a replayed one failing again among them) wait for the next replay.
        Each chunk of `CHUNK` is taken (`Store.take_dead_letters`: held for
        ``hold`` seconds, in a store transaction of its own), published to the
        group with no transaction open, and deleted as far as the transport
        confirmed it: two replays at once send each letter once (one skips what
        the other holds), a purged letter is not sent, and a replay cut short
        leaves its chunk for the next replay (at once when the transport went
        down; once ``hold`` ran out after a kill), whose copies the consumer's
        token (the kept message id by default) makes duplicates. A letter the
        transport refuses for good stays as it was, and `ReplayRefusedError`
        names it once the rest went. Each publish runs the app's
        ``before_publish`` / ``after_publish`` hooks (`Publish.replay` set).
        """
        chosen = self._choose(group, ids)
        if not force:
            self._refuse_loops(group, chosen, max_replays)
        run = _Run()
        for start in range(0, len(chosen), CHUNK):
            part = chosen[start:start + CHUNK]
            taken = self.store.take_dead_letters(group, part, hold)
            run.skipped += len(part) - len(taken)
            if taken:
                sent = self._send(group, taken, run)
                self.store.settle_dead_letters(sent, [t.id for t in taken if t.id is not None and t.id not in sent])
                run.replayed += len(sent)
            if progress is not None:
                progress(len(part))
            if run.outage is not None:
                raise _stopped(run.outage, group, run.replayed, len(chosen))
        if run.skipped:
            log.warning("dead_letters_skipped", group=group, count=run.skipped,
                        why="held by another replay (one that died lets go within its hold), or purged meanwhile")
        log.info("dead_letters_replayed", group=group, count=run.replayed, refused=len(run.refused))
        if run.refused:
            raise _refused(group, run)
        return run.replayed

    def _send(self, group: str, letters: Sequence[DeadLetter], run: _Run) -> list[int]:
        """Publish ``letters`` by origin topic; the ids the transport took. A topic's letters it
        refuses together go again one by one, so only the letter at fault stays behind."""
        sent: list[int] = []
        for topic, batch in _by_origin_topic(letters).items():
            try:
                self._publish(group, topic, [message for _, message in batch])
            except BackendUnavailableError as exc:
                run.outage = exc
            except TransportError:
                sent += self._send_alone(group, topic, batch, run)
            else:
                sent += [letter_id for letter_id, _ in batch]
            if run.outage is not None:
                break
        return sent

    def _send_alone(self, group: str, topic: str, batch: list[tuple[int, OutgoingMessage]], run: _Run) -> list[int]:
        sent: list[int] = []
        for letter_id, message in batch:
            try:
                self._publish(group, topic, [message])
            except BackendUnavailableError as exc:
                run.outage = exc
                break
            except TransportError as exc:
                run.refused[letter_id] = str(exc)
                log.error("dead_letter_replay_refused", group=group, letter=letter_id, topic=topic, error=str(exc))
            else:
                sent.append(letter_id)
        return sent

    def _publish(self, group: str, topic: str, messages: list[OutgoingMessage]) -> None:
        with self.middleware.publishing(topic, None, len(messages), replayed=[m.headers for m in messages]) as added:
            if added:
                messages = [replace(m, headers={**m.headers, **added}) for m in messages]
            self.transport.publish_to_group(group, topic, messages)

    def purge(self, group: str, ids: Sequence[int] | None = None, *, progress: Progress | None = None) -> int:
        """Delete the chosen dead letters (all of ``group`` by default) in chunks, but those a replay
        holds (it is sending them); return how many."""
        chosen = self._choose(group, ids)
        deleted = 0
        for start in range(0, len(chosen), PURGE_CHUNK):
            part = chosen[start:start + PURGE_CHUNK]
            deleted += self.store.delete_dead_letters(part)
            if progress is not None:
                progress(len(part))
        log.info("dead_letters_purged", group=group, count=deleted)
        return deleted

    def _choose(self, group: str, ids: Sequence[int] | None) -> list[int]:
        """The ids of the letters to act on, oldest first, each once; `DeadLetterNotFoundError`
        naming every id asked for that is not ``group``'s, before anything changes."""
        if ids is None:
            return self.store.dead_letter_ids(group)
        wanted = sorted(set(ids))
        found = set(self.store.dead_letter_ids(group, wanted))
        missing = [letter_id for letter_id in wanted if letter_id not in found]
        if missing:
            raise DeadLetterNotFoundError(f"no dead letter {_named(missing)} in group {group!r}")
        return wanted

    def _refuse_loops(self, group: str, chosen: Sequence[int], max_replays: int) -> None:
        looping = self.store.dead_letter_ids(group, chosen, min_replays=max_replays) if chosen else []
        if looping:
            raise ReplayLoopError(
                f"dead letters {_named(looping)} of group {group!r} were replayed as often as max_replays "
                f"({max_replays}) allows; fix the cause, or replay with force=True (--force on the command line)"
            )


class _Run:
    """What one replay did so far: letters replayed, skipped, refused (id: why), the outage that stopped it."""

    def __init__(self) -> None:
        self.replayed = 0
        self.skipped = 0  # chosen, but held by another replay or purged meanwhile
        self.refused: dict[int, str] = {}
        self.outage: BackendUnavailableError | None = None


def _refused(group: str, run: _Run, shown: int = 10) -> ReplayRefusedError:
    """What the replay did, naming the first ``shown`` letters the transport refused, and why."""
    named = "; ".join(f"dead letter {letter_id}: {why}" for letter_id, why in list(run.refused.items())[:shown])
    more = f"; and {len(run.refused) - shown} more" if len(run.refused) > shown else ""
    return ReplayRefusedError(f"replayed {run.replayed} dead letter(s) of group {group!r}; the transport refused "
                              f"{named}{more} (left in place)", run.replayed, run.refused)


def _stopped(outage: BackendUnavailableError, group: str, replayed: int, chosen: int) -> BackendUnavailableError:
    """``outage`` (of its own type, so callers catch it as before) saying what the replay did
    before it and what an operator does next."""
    log.warning("dead_letter_replay_stopped", group=group, replayed=replayed, chosen=chosen, error=str(outage))
    stopped = type(outage)(f"{outage}; replayed {replayed} of {chosen} dead letter(s) of group {group!r} "
                           f"before that, the others stay: replay again once it is back")
    stopped.__cause__ = outage
    return stopped


def _named(ids: Sequence[int], shown: int = 20) -> str:
    """``ids`` as a list a person reads: the first ``shown``, then how many more."""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(str(letter_id) for letter_id in ids[:shown]) + more


def _by_origin_topic(letters: Sequence[DeadLetter]) -> dict[str, list[tuple[int, OutgoingMessage]]]:
    """The letters' ids with their original messages, each with its replay count, by the topic
    they came from."""
    by_topic: dict[str, list[tuple[int, OutgoingMessage]]] = {}
    for letter in letters:
        m = letter.message
        headers = {k: v for k, v in m.headers.items() if k != ORIGIN_TOPIC_HEADER}
        headers[REPLAYS_HEADER] = str(letter.replays + 1)
        outgoing = OutgoingMessage(m.payload, key=m.key, headers=headers, message_id=m.id)
        by_topic.setdefault(origin_topic(m), []).append((letter.id or 0, outgoing))
    return by_topic
