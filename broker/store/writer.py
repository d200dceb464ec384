"""`BatchWriter`: turns a prepared batch into frames, consume-queue and index entries.

This is the hot path of `MessageStore.append` (run under the writer lock), so
it works column-wise, like `prepare`: log offsets are a running sum of the
sizes, queue offsets come from one counter per (topic, queue), and headers,
CRCs, frames, consume-queue entries and results are each built by one ``map``
over the batch. The batch is written with one ``pwrite`` (per segment), each
consume queue gets one slice assignment, the key index one pass.
"""

from __future__ import annotations

from itertools import accumulate, chain, compress, count, repeat
from operator import itemgetter

from crc32c import crc32c

from broker.store import codec
from broker.store.commitlog import CommitLog
from broker.store.consumequeue import ENTRY
from broker.store.keyindex import KeyIndex, offset_in_id
from broker.store.prepare import Prepared
from broker.store.queues import QueueTable
from broker.store.record import AppendResult

_pack_header = codec.HEADER.pack
_pack_prefix = codec.PREFIX.pack
_pack_entry = ENTRY.pack
_MAGIC, _VERSION = codec.MAGIC, codec.VERSION
_new_result = tuple.__new__
_log_offset = itemgetter(1)

Place = tuple[str, int]


class BatchWriter:
    """Appends prepared batches to the log and dispatches them to queues and index."""

    def __init__(self, commit_log: CommitLog, queues: QueueTable, index: KeyIndex,
                 instance: bytes) -> None:
        self._log = commit_log
        self._queues = queues
        self._index = index
        self._id_format = instance + b"%016x"

    def write(self, batch: Prepared, store_time: float) -> list[AppendResult]:
        """Append ``batch`` stamped with ``store_time``; return where each record landed."""
        sizes = batch.sizes
        offsets = list(accumulate(sizes, initial=self._log.end))
        end = offsets.pop()
        ids = self._ids(batch, offsets)
        places = list(zip(batch.topics, batch.queues))
        starts = {place: self._queues.ensure(*place).length for place in set(places)}
        counters = {place: count(start) for place, start in starts.items()}
        queue_offsets = list(map(next, map(counters.__getitem__, places)))
        heads = map(_pack_header, batch.lengths, repeat(_VERSION), batch.queues, queue_offsets,
                    repeat(store_time), batch.attempts, map(len, batch.topics_b), map(len, ids),
                    map(len, batch.keys), map(len, batch.tags), map(len, batch.headers),
                    map(len, batch.bodies))
        payloads = list(map(b"".join, zip(heads, batch.topics_b, ids, batch.keys, batch.tags,
                                          batch.headers, batch.bodies)))
        prefixes = map(_pack_prefix, repeat(_MAGIC), map(crc32c, payloads))
        self._append(list(chain.from_iterable(zip(prefixes, payloads))), sizes, end)
        self._dispatch(places, queue_offsets, starts,
                       list(map(_pack_entry, offsets, sizes, batch.tag_hashes)))
        self._index_batch(batch, ids, offsets, int(store_time * 1000))
        self._index.advance(end)
        message_ids = (batch.message_ids if not batch.generated
                       else list(map(bytes.decode, ids)) if not any(batch.ids)
                       else [given or made.decode() for given, made in zip(batch.message_ids, ids)])
        return list(map(_new_result, repeat(AppendResult), zip(
            batch.topics, batch.queues, queue_offsets, offsets, message_ids, sizes)))

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

    def _dispatch(self, places: list[Place], queue_offsets: list[int], starts: dict[Place, int],
                  entries: list[bytes]) -> None:
        """Write each consume queue's new entries with one slice assignment."""
        if len(starts) == 1:
            [place] = starts
            self._queues.ensure(*place).put_packed(b"".join(entries))
            return
        in_queue_order = sorted(range(len(places)), key=places.__getitem__)  # stable
        data = b"".join(map(entries.__getitem__, in_queue_order))
        lasts = dict(zip(places, queue_offsets))
        position = 0
        for place in sorted(lasts):
            taken = (lasts[place] + 1 - starts[place]) * ENTRY.size
            self._queues.ensure(*place).put_packed(data[position : position + taken])
            position += taken

    def _index_batch(self, batch: Prepared, ids: list[bytes], offsets: list[int],
                     store_ms: int) -> None:
        """Index keys, and the ids producers gave (store-made ids say where they are)."""
        sizes = batch.sizes
        entries = list(zip(batch.key_hashes, compress(offsets, batch.keyed),
                           compress(sizes, batch.keyed), repeat(store_ms)))
        if batch.id_hashes:
            named = batch.named
            entries.extend(
                (hashed, offset, size, store_ms) for hashed, offset, size, id_b in zip(
                    batch.id_hashes, compress(offsets, named), compress(sizes, named),
                    compress(ids, named))
                if offset_in_id(id_b) != offset
            )
            entries.sort(key=_log_offset)  # index files cover log ranges in order
        if entries:
            self._index.add_many(entries)
