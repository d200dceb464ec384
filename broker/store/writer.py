"""`BatchWriter`: turns a prepared batch into frames, consume-queue and index entries.

This is the hot path of `MessageStore.append` (run under the writer lock), so
it works column-wise, like `prepare`: log offsets are a running sum of the
sizes, queue offsets come from one counter per (topic, queue), and headers,
CRCs, frames, consume-queue entries and results are each built by one ``map``
over the batch. The batch is written with one ``pwrite`` (per segment), each
consume queue gets one slice assignment, the key index one pass.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate, chain, compress, count, repeat
from operator import ne, sub

from crc32c import crc32c

from broker.store import codec
from broker.store.commitlog import CommitLog
from broker.store.consumequeue import ENTRY, ConsumeQueue
from broker.store.keyindex import STORE_ID_LENGTH, KeyIndex, offset_in_id
from broker.store.prepare import Prepared
from broker.store.queues import QueueTable
from broker.store.recent import RecentRecords
from broker.store.record import Appended

_pack_header = codec.HEADER.pack
_pack_prefix = codec.PREFIX.pack
_pack_entry = ENTRY.pack
_pack_entry_into = ENTRY.pack_into
_MAGIC, _VERSION = codec.MAGIC, codec.VERSION

Place = tuple[str, int] | int
Entries = tuple[Sequence[int], Sequence[int], Sequence[int]]  # key-index hashes, log offsets, sizes
NO_ENTRIES: Entries = ((), (), ())


class BatchWriter:
    """Appends prepared batches to the log and dispatches them to queues and index."""

    def __init__(self, commit_log: CommitLog, queues: QueueTable, index: KeyIndex,
                 instance: bytes, recent: RecentRecords) -> None:
        self._log = commit_log
        self._queues = queues
        self._index = index
        self._recent = recent
        self._id_format = instance + b"%016x"
        self._by_topic: dict[str, dict[int, ConsumeQueue]] = {}

    def write(self, batch: Prepared, store_time: float) -> Appended:
        """Append ``batch`` stamped with ``store_time``; return where each record landed."""
        sizes = batch.sizes
        offsets = list(accumulate(sizes, initial=self._log.end))
        end = offsets.pop()
        ids = self._ids(batch, offsets)
        places, queues = self._places(batch)
        starts = {place: consume_queue.length for place, consume_queue in queues.items()}
        counters = {place: count(start) for place, start in starts.items()}
        queue_offsets = list(map(next, map(counters.__getitem__, places)))
        payloads = _payloads(batch, ids, queue_offsets, store_time)
        prefixes = map(_pack_prefix, repeat(_MAGIC), map(crc32c, payloads))
        start = self._log.end
        try:
            self._append(list(chain.from_iterable(zip(prefixes, payloads))), sizes, end)
            self._dispatch(places, queue_offsets, queues, starts, offsets, sizes, batch.tag_hashes)
            self._index_batch(batch, ids, offsets, int(store_time * 1000))
        except OSError:  # a full disk: the batch is cut back whole, as if never written
            for place, consume_queue in queues.items():
                consume_queue.truncate(starts[place])
            self._log.truncate(start)
            raise
        self._index.advance(end)
        message_ids = (batch.message_ids if not batch.generated
                       else list(map(bytes.decode, ids)) if not any(batch.ids)
                       else [given or made.decode() for given, made in zip(batch.message_ids, ids)])
        self._recent.add(offsets, sizes, message_ids, batch.key_texts, batch.tag_texts,
                         batch.header_maps, batch.bodies, store_time, batch.attempts)
        return Appended(batch.topics, batch.queues, queue_offsets, offsets, message_ids, sizes)

    def _places(self, batch: Prepared) -> tuple[Sequence[Place], dict[Place, ConsumeQueue]]:
        """Each record's place and the consume queue of every place in the batch.

        A place is the queue number when the whole batch goes to one topic (the
        common case: cheaper to hash), else (topic, queue).
        """
        topics = set(batch.topics)
        if len(topics) == 1:
            [topic] = topics
            known = self._by_topic.setdefault(topic, {})
            numbers = set(batch.queues)
            for queue in numbers.difference(known):
                known[queue] = self._queues.ensure(topic, queue)
            return batch.queues, {queue: known[queue] for queue in numbers}
        pairs = list(zip(batch.topics, batch.queues))
        return pairs, {pair: self._queues.ensure(*pair) for pair in set(pairs)}

    def _ids(self, batch: Prepared, offsets: list[int]) -> list[bytes]:
        """The records' ids, made from their log offsets where the producer gave none."""
        if not batch.generated:
            return batch.ids
        made = map(self._id_format.__mod__, offsets)
        if not any(batch.ids):
            return list(made)
        return [given or new for given, new in zip(batch.ids, made)]

    def _append(self, parts: list[bytes], sizes: list[int], end: int) -> None:
        """Write the frames (``parts``: prefix, payload, ...), rolling segments where needed."""
        commit_log = self._log
        room = commit_log.room()
        if end - commit_log.end <= room:
            commit_log.append(parts)
            return
        first = 0
        for number, size in enumerate(sizes):
            if size > room:  # a record never spans two segments
                commit_log.append(parts[2 * first : 2 * number])
                commit_log.roll()
                room, first = commit_log.segment_size, number
            room -= size
        commit_log.append(parts[2 * first :])

    def _dispatch(self, places: Sequence[Place], queue_offsets: list[int],
                  queues: dict[Place, ConsumeQueue], starts: dict[Place, int], offsets: list[int],
                  sizes: list[int], tag_hashes: list[int]) -> None:
        """Pack each record's consume-queue entry straight into its queue's mapped file."""
        lasts = dict(zip(places, queue_offsets))
        files = {place: queue.file_for(starts[place], lasts[place])
                 for place, queue in queues.items()}
        if None in files.values():  # a queue's entries cross into its next file
            for place, queue in queues.items():
                mine = [index for index, other in enumerate(places) if other == place]
                queue.put_packed(b"".join(map(_pack_entry, map(offsets.__getitem__, mine),
                                              map(sizes.__getitem__, mine),
                                              map(tag_hashes.__getitem__, mine))))
            return
        bases = {place: base for place, (_, base) in files.items()}  # type: ignore[misc]
        maps = {place: mapped for place, (mapped, _) in files.items()}  # type: ignore[misc]
        positions = map(ENTRY.size.__mul__, map(sub, queue_offsets, map(bases.__getitem__, places)))
        list(map(_pack_entry_into, map(maps.__getitem__, places), positions, offsets, sizes,
                 tag_hashes))
        for place, queue in queues.items():
            queue.extend(lasts[place] + 1)

    def _index_batch(self, batch: Prepared, ids: list[bytes], offsets: list[int],
                     store_ms: int) -> None:
        """Index keys, and the ids producers gave (store-made ids say where they are)."""
        by_key = _chosen(batch.key_hashes, batch.keyed, offsets, batch.sizes)
        by_id = _named_entries(batch, ids, offsets) if batch.id_hashes else NO_ENTRIES
        entries: Entries
        if by_key[0] and by_id[0]:  # index files cover log ranges in order: merge by offset
            merged = sorted(chain(zip(by_key[1], by_key[2], by_key[0]), zip(by_id[1], by_id[2], by_id[0])))
            merged_offsets, merged_sizes, merged_hashes = map(list, zip(*merged))
            entries = (merged_hashes, merged_offsets, merged_sizes)
        else:
            entries = by_key if by_key[0] else by_id
        hashes, log_offsets, sizes = entries
        if hashes:
            self._index.add_many(hashes, log_offsets, sizes, [store_ms] * len(hashes))


def _payloads(batch: Prepared, ids: list[bytes], queue_offsets: list[int],
              store_time: float) -> list[bytes]:
    """Each record's CRC-covered bytes: header, topic, id, key, tag, headers, body.

    A producer's batch of plain messages (one topic, no key, tag or headers, ids and bodies
    of one length, one attempt) differs from record to record only in queue, queue offset,
    id and body: the rest of the header is packed once, and each payload with one ``pack``.
    """
    lengths, body_lengths, attempts, topics = batch.lengths, batch.body_lengths, batch.attempts, batch.topics_b
    count = len(lengths)
    if (lengths.count(lengths[0]) == body_lengths.count(body_lengths[0]) == attempts.count(attempts[0])
            == topics.count(topics[0]) == count
            and not (any(batch.key_lengths) or any(batch.tag_lengths) or any(batch.header_lengths))):
        lead = _LEAD.pack(lengths[0], _VERSION)
        trail = _TRAIL.pack(store_time, attempts[0], len(topics[0]), len(ids[0]), 0, 0, 0,
                            body_lengths[0]) + topics[0]
        plain = _plain(len(trail), len(ids[0]), body_lengths[0])
        return list(map(plain.pack, repeat(lead), batch.queues, queue_offsets, repeat(trail), ids,
                        batch.bodies))
    heads = map(_pack_header, lengths, repeat(_VERSION), batch.queues, queue_offsets,
                repeat(store_time), attempts, batch.topic_lengths, map(len, ids),
                batch.key_lengths, batch.tag_lengths, batch.header_lengths, body_lengths)
    return list(map(b"".join, zip(heads, topics, ids, batch.keys, batch.tags, batch.headers,
                                  batch.bodies)))


_LEAD = struct.Struct("<IB")  # `codec.HEADER` up to the queue: length, version
_TRAIL = struct.Struct("<dIHHHHII")  # after the queue offset: store time ... body length
assert _LEAD.format + "IQ" + _TRAIL.format.lstrip("<") == codec.HEADER.format


@lru_cache(maxsize=256)
def _plain(trail_length: int, id_length: int, body_length: int) -> struct.Struct:
    """The payload of a plain record: lead, queue, queue offset, trail and topic, id, body."""
    return struct.Struct(f"<{_LEAD.size}sIQ{trail_length}s{id_length}s{body_length}s")


def _named_entries(batch: Prepared, ids: list[bytes],
                   offsets: list[int]) -> Entries:
    """The index entries of the ids producers gave, but for an id naming its own record."""
    by_id = _chosen(batch.id_hashes, batch.named, offsets, batch.sizes)
    named_ids = ids if len(by_id[0]) == len(ids) else list(compress(ids, batch.named))
    if STORE_ID_LENGTH not in set(map(len, named_ids)):
        return by_id
    needed = list(map(ne, map(offset_in_id, named_ids), by_id[1]))
    return list(compress(by_id[0], needed)), list(compress(by_id[1], needed)), list(compress(by_id[2], needed))


def _chosen(hashes: Sequence[int], chosen: Sequence[bool], offsets: list[int],
            sizes: list[int]) -> Entries:
    """The index entries (hash, log offset, size: a column each) of the records ``chosen`` picks
    (``hashes`` has one per chosen record)."""
    if len(hashes) == len(offsets):
        return hashes, offsets, sizes
    return hashes, list(compress(offsets, chosen)), list(compress(sizes, chosen))
