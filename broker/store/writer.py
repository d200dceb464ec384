"""`BatchWriter`: turns a batch of prepared records into frames, consume-queue and index entries.

This is the hot path of `MessageStore.append` (run under the writer lock), so
it works batch-wise: one ``pwrite`` per batch (per segment), one slice
assignment per consume-queue file, one pass over the key index, and no
per-record method calls in the loop.
"""

from __future__ import annotations

from crc32c import crc32c

from broker.store import codec
from broker.store.commitlog import CommitLog
from broker.store.keyindex import KeyIndex, id_hash, key_hash, offset_in_id
from broker.store.prepare import Prepared
from broker.store.queues import QueueTable
from broker.store.record import AppendResult

_HEADER_SIZE = codec.HEADER.size
_pack_header = codec.HEADER.pack
_pack_prefix = codec.PREFIX.pack
_MAGIC, _VERSION = codec.MAGIC, codec.VERSION


class BatchWriter:
    """Appends prepared batches to the log and dispatches them to queues and index."""

    def __init__(self, commit_log: CommitLog, queues: QueueTable, index: KeyIndex,
                 instance: bytes) -> None:
        self._log = commit_log
        self._queues = queues
        self._index = index
        self._instance = instance

    def write(self, prepared: list[Prepared], store_time: float) -> list[AppendResult]:
        """Append ``prepared`` stamped with ``store_time``; return where each record landed."""
        commit_log, instance = self._log, self._instance
        store_ms = int(store_time * 1000)
        offset = commit_log.end
        room = commit_log.room()
        parts: list[bytes] = []
        placed: dict[tuple[str, int], list] = {}  # (topic, queue) -> [next offset, entries]
        index_entries: list[tuple[int, int, int, int]] = []
        results: list[AppendResult] = []
        for (topic, topic_b, queue, message_id, id_b, tail, attempt, key_length, tag_length,
             headers_length, body_length, fixed, tag_h) in prepared:
            place = placed.get((topic, queue))
            if place is None:
                place = placed[(topic, queue)] = [self._queues.ensure(topic, queue).length, []]
            queue_offset = place[0]
            place[0] = queue_offset + 1
            if not id_b:
                id_b = b"%s%016x" % (instance, offset)
            length = fixed + len(id_b)
            payload = b"".join((
                _pack_header(length, _VERSION, queue, queue_offset, store_time, attempt,
                             len(topic_b), len(id_b), key_length, tag_length, headers_length,
                             body_length),
                topic_b, id_b, tail,
            ))
            size = length + 6
            if size > room:
                commit_log.append(parts)
                parts = []
                commit_log.roll()
                room = commit_log.segment_size
            room -= size
            parts.append(_pack_prefix(_MAGIC, crc32c(payload)))
            parts.append(payload)
            place[1].append((offset, size, tag_h))
            if key_length:
                key_b = tail[:key_length]
                index_entries.append((key_hash(topic_b, key_b), offset, size, store_ms))
            if message_id and offset_in_id(id_b) != offset:
                index_entries.append((id_hash(id_b), offset, size, store_ms))
            results.append(AppendResult(topic, queue, queue_offset, offset,
                                        message_id or id_b.decode(), size))
            offset += size
        commit_log.append(parts)
        for (topic, queue), (_, entries) in placed.items():
            self._queues.ensure(topic, queue).put_many(entries)
        self._index.add_many(index_entries)
        self._index.advance(offset)
        return results
