"""`redis://HOST:PORT/DB`: a transport on Redis Streams, one stream per topic queue.

Publishing appends with ``XADD`` (entry id ``0-<offset + 1>``); a group's
cursor is a Redis consumer group read with ``XREADGROUP ... NOACK``. Leases
and scheduled redeliveries live in sorted sets scored by the injected clock,
not in the stream's pending list: the visibility timeout then follows the
same clock as delays (and tests), which ``XAUTOCLAIM``'s server-side idle
time cannot. Every step that must be atomic is one Lua script (`redis_layout`);
those that append to or read a queue first adopt what another program appended
with ids of its own (`redis_adoption`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, cast

import redis
import structlog

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import BackendUnavailableError, TransportError
from backends.refusal import FirstContact
from backends.transport import redis_adoption as adoption
from backends.transport import redis_layout as layout
from backends.transport.base import seconds
from backends.transport.leasing import (
    DEFAULT_QUEUES,
    DEFAULT_VISIBILITY_TIMEOUT,
    LeasingTransport,
)
from backends.transport.redis_errors import translate
from backends.types import DeadLetter, Failure, Message, OutgoingMessage, QueueRef
from backends.urls import redact
from backends.values import positive

log = structlog.get_logger(__name__)
OUTSTANDING = ("inflight", "scheduled")
PER_MESSAGE = ("state", "redelivered")
DEFAULT_REQUEST_TIMEOUT = 5.0
"""Seconds a command may go unanswered (redis-py 6's default socket timeout, set here so that an
older redis-py, whose default is none, does not wait on a hung server for ever)."""


class RedisStreamsTransport(LeasingTransport):
    """A `Transport` on one Redis server; ``namespace`` prefixes every key it writes."""

    def __init__(
        self,
        url: str,
        clock: Clock = SYSTEM_CLOCK,
        *,
        namespace: str = "reliable",
        queues: int = DEFAULT_QUEUES,
        visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
        poll_interval: float = 0.05,
        request_timeout: float | str = DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        super().__init__(
            clock, queues, visibility_timeout, positive("transport option poll_interval", poll_interval)
        )
        self._url, self._keys = url, layout.Keys(namespace)
        self._contact = FirstContact("[transport] url", redact(url))
        # every command here answers at once (a fetch polls, it never blocks on the server): a reply
        # later than request_timeout, or a connection not made by then, is a server hung or cut off
        # (an outage), not a slow one
        self._timeout = timeout = seconds("request_timeout", request_timeout)
        # Any: redis-py's stubs type replies as bytes | str; without decode_responses they are bytes
        self._redis: Any = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._scripts = {
            name: self._redis.register_script(getattr(layout, name))
            for name in ("PUBLISH", "CLAIM", "NACK", "DEAD_LETTER")
        }
        self._rotation = itertools.count()
        self._queue_counts: dict[str, int] = {}
        self._max_bulk: int | None = None  # the server's proto-max-bulk-len, asked at the first publish

    def _ack(self, group: str, messages: Sequence[Message]) -> None:
        by_topic: dict[str, list[str]] = {}
        for message in messages:
            by_topic.setdefault(message.topic, []).append(
                layout.member(message.queue, message.offset)
            )
        with self._errors() as client:
            pipe = client.pipeline()
            for topic, names in by_topic.items():
                for kind in OUTSTANDING:
                    pipe.zrem(self._keys.group(kind, group, topic), *names)
                for kind in PER_MESSAGE:
                    pipe.hdel(self._keys.group(kind, group, topic), *names)
            pipe.execute()

    def _nack(self, group: str, message: Message, due_at: float, failed_at: float) -> None:
        state = json.dumps({"first_failure_at": failed_at})
        name = layout.member(message.queue, message.offset)
        with self._errors():
            self._scripts["NACK"](
                args=[self._keys.ns, group, message.topic, name, repr(due_at), state]
            )

    def _dead_letter(self, group: str, message: Message, failure: Failure) -> bool:
        fields = layout.entry(
            message.id, message.key, message.headers, message.payload, message.published_at
        )
        fields.update(
            topic=message.topic,
            queue=message.queue,
            offset=message.offset,
            attempt=message.attempt,
            first_failure_at=json.dumps(message.first_failure_at),
            failure=json.dumps(asdict(failure)),
        )
        flat = [part for pair in fields.items() for part in pair]
        name = layout.member(message.queue, message.offset)
        with self._errors():
            return bool(
                self._scripts["DEAD_LETTER"](args=[self._keys.ns, group, message.topic, name, *flat])
            )

    def _extend(self, group: str, messages: Sequence[Message], until: float) -> None:
        with self._errors() as client:
            pipe = client.pipeline()
            for message in messages:
                key = self._keys.group("inflight", group, message.topic)
                pipe.zadd(key, {layout.member(message.queue, message.offset): until}, xx=True)
            pipe.execute()

    def _commit(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        with self._errors() as client:
            for ref, offset in offsets.items():
                key = self._keys.group("committed", group, ref.topic)
                current = int(client.hget(key, str(ref.queue)) or 0)
                if offset > current:  # one committer per group member queue: no lost race matters
                    client.hset(key, str(ref.queue), offset)

    def _read_and_leased(self, group: str, topic: str) -> tuple[dict[int, int], list[tuple[int, int]]]:
        queues = self._queues_of(topic)
        with self._errors() as client:
            return layout.read_and_leased(client, self._keys, group, topic, queues)

    def committed(self, group: str, topic: str) -> dict[int, int]:
        """``group``'s committed position per queue of ``topic`` (what `commit` recorded)."""
        with self._errors() as client:
            stored = client.hgetall(self._keys.group("committed", group, topic))
        return {int(queue): int(offset) for queue, offset in stored.items()}

    def _pending(self, group: str, topic: str) -> int:
        queues = self._queues_of(topic)
        with self._errors() as client:
            pipe = client.pipeline()
            for queue in range(queues):
                pipe.get(self._keys.head(topic, queue))
                pipe.xinfo_groups(self._keys.stream(topic, queue))
                pipe.xrevrange(self._keys.stream(topic, queue), count=1)
                pipe.xlen(self._keys.stream(topic, queue))
            for kind in OUTSTANDING:
                pipe.zcard(self._keys.group(kind, group, topic))
            pipe.zcard(self._keys.delayed(topic))
            replies = pipe.execute(raise_on_error=False)
        unread = 0
        for at in range(0, 4 * queues, 4):
            head, groups, top, length = int(replies[at] or 0), replies[at + 1], replies[at + 2], replies[at + 3]
            groups = groups if isinstance(groups, list) else []  # no stream yet: an error reply
            ours = [g for g in groups if g["name"] == group.encode()]
            cursor = layout.offset_of(ours[0]["last-delivered-id"]) + 1 if ours else 0
            foreign = adoption.foreign_on_top(top, head)  # the next fetch adopts it
            # a stream deleted or trimmed under the head holds fewer: the layout's entries end at
            # the top one, and are at most as many as the stream's length
            stored = head if foreign else layout.offset_of(top[0][0]) + 1 if top else 0
            length = length if isinstance(length, int) else 0
            unread += max(0, min(min(head, stored) - cursor, length - foreign)) + foreign
        return unread + sum(replies[4 * queues :])

    def _next_due(self, group: str, topic: str) -> float | None:
        return self._earliest(group, topic, ("scheduled",))

    def _queue_count(self, topic: str) -> int:
        return self._queues_of(topic, create=True)

    def _seek(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        with self._errors() as client:
            for ref, offset in offsets.items():
                if not 0 <= ref.queue < self._queues_of(ref.topic, create=True) or offset < 0:
                    raise TransportError(f"cannot seek {ref} to offset {offset}: no such place")
                stream = self._keys.stream(ref.topic, ref.queue)
                offset = min(offset, int(client.get(self._keys.head(ref.topic, ref.queue)) or 0))
                try:
                    client.xgroup_create(stream, group, "0", mkstream=True)
                except redis.ResponseError:
                    pass  # the group exists
                client.xgroup_setid(stream, group, f"0-{offset}")
                self._forget(client, group, ref, offset)
        self._signal()

    def dead_letter_records(self, group: str) -> list[DeadLetter]:
        self._check_open()
        with self._errors() as client:
            entries = client.xrange(self._keys.dead_letters(group))
        records = []
        for number, (_, raw) in enumerate(entries, start=1):
            fields = {name.decode(): value for name, value in raw.items()}
            ref = (fields["topic"].decode(), int(fields["queue"]), int(fields["offset"]))
            message = layout.to_message(
                fields, ref, int(fields["attempt"]), json.loads(fields["first_failure_at"])
            )
            failure = Failure(**json.loads(fields["failure"]))
            records.append(DeadLetter(group, message, None, failure, id=number))
        return records

    def purge(self) -> None:
        """Delete every key of this transport's namespace (tests, resets)."""
        with self._errors() as client:
            keys = list(client.scan_iter(match=f"{self._keys.ns}:*", count=10_000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])
        self._queue_counts.clear()

    def close(self) -> None:
        super().close()
        self._redis.close()

    # primitives of LeasingTransport

    def _append(self, topic: str, messages: Sequence[OutgoingMessage], now: float, *,
                timeout: float | None = None) -> None:
        entries = [layout.entry(cast(str, m.message_id), m.key, m.headers, m.payload, now) for m in messages]
        limit = self._max_argument()
        for fields in entries:
            layout.check_arguments(topic, fields, limit)
        queues = self._queues_of(topic, create=True)
        args: list[Any] = [self._keys.ns, topic]
        for message, fields in zip(messages, entries, strict=True):
            args += [
                self._router.queue_for(topic, message.key, queues),
                fields["id"],  # stamped by Transport.publish
                "-" if message.key is None else f"+{message.key}",
                fields["headers"],
                message.payload,
                fields["published_at"],
                repr(now + message.delay) if message.delay > 0 else "",
            ]
        with self._bounded(timeout) as client:  # one script: all of it stored, or none (OOM)
            adoption.log_adopted(topic, self._scripts["PUBLISH"](args=args, client=client))
        self._signal()

    def _claim(
        self, group: str, topic: str, max_messages: int, now: float, lease_for: float
    ) -> list[Message]:
        queues = self._queues_of(topic)
        if not queues:
            return []
        lease = repr(now + lease_for)
        args: list[Any] = [
            self._keys.ns,
            group,
            topic,
            queues,
            repr(now),
            lease,
            max_messages,
            next(self._rotation) % queues,
        ]
        with self._errors():
            claimed, adopted, vanished, recreated = self._scripts["CLAIM"](args=args)
        adoption.log_adopted(topic, adopted)
        for queue, offset in recreated:
            log.warning("transport.group_recreated", group=group, topic=topic, queue=queue, offset=offset,
                        reason="the group was deleted from Redis (XGROUP DESTROY, or its stream deleted) and "
                               "made again: it reads the stream again from this offset, its start (what was "
                               "done is skipped by its token)")
        for name in vanished:
            queue, offset = layout.position(name)
            log.warning("transport.message_vanished", group=group, topic=topic, queue=queue,
                        offset=offset, reason="its stream entry was deleted from Redis")
        messages = []
        for name, kind, state, flat, redeliveries in claimed:
            queue, offset = layout.position(name)
            fields = {flat[i].decode("utf-8", "replace"): flat[i + 1] for i in range(0, len(flat), 2)}
            stored = json.loads(state) if state else {}
            attempt = 1 + int(redeliveries)
            if kind == b"expired":
                log.warning(
                    "transport.lease_expired",
                    group=group,
                    topic=topic,
                    queue=queue,
                    offset=offset,
                    attempt=attempt,
                )
            messages.append(
                layout.to_message(
                    fields,
                    (topic, queue, offset),
                    attempt,
                    stored.get("first_failure_at"),
                )
            )
        return messages

    def _wake_at(self, group: str, topic: str) -> float | None:
        return self._earliest(group, topic, OUTSTANDING)

    # helpers

    def _max_argument(self) -> int:
        """The server's ``proto-max-bulk-len``: the largest argument it reads (it closes the
        connection on a larger one, which looks like an outage); Redis's default where ``CONFIG``
        is refused (an ACL, a managed Redis)."""
        if self._max_bulk is None:
            with self._errors() as client:
                try:
                    reply = client.config_get(layout.MAX_BULK_SETTING)
                except redis.ResponseError:
                    reply = {}
            told = {str(name, "utf-8") if isinstance(name, bytes) else name: value for name, value in reply.items()}
            self._max_bulk = int(told.get(layout.MAX_BULK_SETTING) or layout.DEFAULT_MAX_BULK)
        return self._max_bulk

    def _queues_of(self, topic: str, create: bool = False) -> int:
        """The number of queues of ``topic`` (0 while it does not exist); fixed once created."""
        if topic in self._queue_counts:
            return self._queue_counts[topic]
        with self._errors() as client:
            if create:
                client.set(self._keys.queues(topic), self._queues, nx=True)
            count = int(client.get(self._keys.queues(topic)) or 0)
        if count:
            self._queue_counts[topic] = count
        return count

    def _forget(self, client: Any, group: str, ref: QueueRef, offset: int) -> None:
        """Drop ``group``'s outstanding messages of ``ref`` at or after ``offset`` (read again),
        and those in flight below it for the first time (done, as the consumer's saved offset
        says; a redelivery it passed was scheduled then, and is not known done)."""
        redelivered = self._keys.group("redelivered", group, ref.topic)
        for kind in OUTSTANDING:
            key = self._keys.group(kind, group, ref.topic)
            ours = [name for name in client.zrange(key, 0, -1) if layout.position(name)[0] == ref.queue]
            again = client.hmget(redelivered, ours) if ours and kind == "inflight" else [None] * len(ours)
            doomed = [name for name, count in zip(ours, again)
                      if layout.position(name)[1] >= offset or (kind == "inflight" and not int(count or 0))]
            if doomed:
                client.zrem(key, *doomed)
                for kind in PER_MESSAGE:
                    client.hdel(self._keys.group(kind, group, ref.topic), *doomed)

    def _earliest(self, group: str, topic: str, kinds: tuple[str, ...]) -> float | None:
        keys = [self._keys.group(kind, group, topic) for kind in kinds] + [
            self._keys.delayed(topic)
        ]
        with self._errors() as client:
            pipe = client.pipeline()
            for key in keys:
                pipe.zrange(key, 0, 0, withscores=True)
            due = [score for reply in pipe.execute() for _, score in reply]
        return min(due) if due else None

    @contextmanager
    def _bounded(self, timeout: float | None) -> Iterator[Any]:
        """`_errors`, on a connection of its own whose requests wait at most ``timeout`` seconds
        where that is less than ``request_timeout`` (a caller's last try: `Transport.publish`)."""
        if timeout is None or timeout >= self._timeout:
            with self._errors() as client:
                yield client
            return
        bounded = redis.Redis.from_url(self._url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            with self._errors(bounded) as client:
                yield client
        finally:
            bounded.close()

    @contextmanager
    def _errors(self, client: Any = None) -> Iterator[Any]:
        """The client (``client`` if given), with Redis failures raised as the project's errors."""
        try:
            yield self._redis if client is None else client
        except redis.AuthenticationError as exc:  # WRONGPASS, NOAUTH: the URL's login
            raise self._contact.refused(f"Redis: {exc}", BackendUnavailableError) from exc
        except redis.RedisError as exc:  # an outage, writes refused for now, or a refusal
            raise translate(exc, self._url) from exc
        else:
            self._contact.accepted()

