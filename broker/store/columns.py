"""Decoding a run of frames read with one system call, column by column.

The read-side twin of `prepare`: the frame headers of the whole run, each with
the topic and the id that follow it, are unpacked with one ``map``, transposed
once (``zip(*heads)``), and every check of `codec.check` (magic, version,
length against the consume-queue entry, queue and queue offset, topic, field
lengths, CRC32C) and every field of `codec.decode` is computed over a whole
column, so the per-record work runs in C rather than in the interpreter loop.
A run of records of one size and one shape (a producer's batch of plain
messages) takes a shorter way (`_decode_uniform`): each record's CRC-covered
bytes are unpacked whole, CRC-checked, then unpacked into every field, body
included, so nothing is computed per record in the interpreter. If anything
is off the run is refused as a whole (``None``) and the reader decodes it
record by record, which names the bad record.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import repeat
from operator import add, sub
from types import MappingProxyType
from typing import Any, NamedTuple

import msgpack
from crc32c import crc32c

from broker.store import codec
from broker.store.record import NO_HEADERS

FRAME = struct.Struct("<HI" + codec.HEADER.format.lstrip("<"))  # prefix and header: one unpack
assert FRAME.size == codec.FRAME_MIN
_PREFIX = codec.PREFIX.size
_ID_LENGTH = 9  # the place of the id's length among FRAME's fields
_BODY_LENGTH = 13  # of the body's
_BAD = (UnicodeDecodeError, ValueError, TypeError, struct.error, msgpack.UnpackException)


class RunColumns(NamedTuple):
    """The decoded fields of a run's records, one list per field, in log order."""

    message_ids: Sequence[str]
    keys: Sequence[str]
    tags: Sequence[str]
    headers: Sequence[Mapping[str, str]]
    bodies: Sequence[bytes]
    store_times: Sequence[float]
    attempts: Sequence[int]


def decode_run(data: bytes, starts: Sequence[int], sizes: Sequence[int], first_queue_offset: int,
               topic: bytes, queue: int) -> RunColumns | None:
    """The records at ``starts`` (positions in ``data``, of the consume-queue ``sizes``) of queue
    (``topic``, ``queue``) from ``first_queue_offset`` on, all intact; None if one is not."""
    if starts and sizes.count(sizes[0]) == len(sizes):
        uniform = _decode_uniform(data, starts, sizes[0], first_queue_offset, topic, queue)
        if uniform is not None:
            return uniform
    heads = _heads(data, starts, len(topic))
    if not heads:
        return None
    (magics, crcs, lengths, versions, queues, queue_offsets, store_times, attempts, topic_lengths,
     id_lengths, key_lengths, tag_lengths, header_lengths, body_lengths, topics, ids) = zip(*heads)
    count = len(heads)
    if not (magics.count(codec.MAGIC) == versions.count(codec.VERSION) == queues.count(queue)
            == topic_lengths.count(len(topic)) == topics.count(topic) == count
            and queue_offsets == tuple(range(first_queue_offset, first_queue_offset + count))
            and lengths == tuple(map(sub, sizes, repeat(_PREFIX)))):
        return None
    ends = list(map(add, starts, sizes))
    body_starts = list(map(sub, ends, body_lengths))
    plain = not (any(key_lengths) or any(tag_lengths) or any(header_lengths))
    fits = id_lengths.count(len(ids[0])) == count  # else ids of several lengths: unpacked as long as the first
    if not (fits and plain):  # where the ids lie is needed
        id_starts = list(map(add, starts, repeat(FRAME.size + len(topic))))
        id_ends = list(map(add, id_starts, id_lengths))
        if not fits:
            ids = tuple(_slices(data, id_starts, id_ends))
    if plain:  # the field lengths add up: the id ends where the body starts
        laid_out = lengths == tuple(map(add, map(add, id_lengths, body_lengths),
                                        repeat(codec.HEADER.size + len(topic))))
    else:
        tag_starts = list(map(add, id_ends, key_lengths))
        header_starts = list(map(sub, body_starts, header_lengths))
        laid_out = list(map(add, tag_starts, tag_lengths)) == header_starts
    if not (laid_out and tuple(map(crc32c, _slices(data, map(add, starts, repeat(_PREFIX)), ends))) == crcs):
        return None
    try:
        message_ids = list(map(bytes.decode, ids))
        if plain:
            keys = tags = [""] * count
            headers: Sequence[Mapping[str, str]] = [NO_HEADERS] * count
        else:
            keys = list(map(bytes.decode, _slices(data, id_ends, tag_starts))) if any(key_lengths) else [""] * count
            tags = (list(map(bytes.decode, _slices(data, tag_starts, header_starts))) if any(tag_lengths)
                    else [""] * count)  # none with a key or a tag (headers alone): nothing to cut
            headers = _headers(data, header_starts, body_starts)
    except _BAD:
        return None
    return RunColumns(message_ids, keys, tags, headers, list(_slices(data, body_starts, ends)),
                      store_times, attempts)


def _decode_uniform(data: bytes, starts: Sequence[int], size: int, first_queue_offset: int,
                    topic: bytes, queue: int) -> RunColumns | None:
    """`decode_run` of records all of one ``size`` and one shape (ids and bodies of one length, no
    key, tag or headers: a producer's batch as a rule): each record's CRC-covered bytes are taken
    whole (one unpack), CRC-checked and then unpacked field by field, body included, so no
    position is computed per record. None if one is not intact or the records differ in shape
    (then `decode_run` checks them the general way)."""
    count = len(starts)
    try:
        magics, crcs, payloads = zip(*map(_framing(size - _PREFIX).unpack_from, repeat(data), starts))
        first = codec.HEADER.unpack_from(payloads[0])
    except struct.error:
        return None
    if magics.count(codec.MAGIC) != count or tuple(map(crc32c, payloads)) != crcs:
        return None
    layout = _layout(len(topic), first[_ID_LENGTH - 2], first[_BODY_LENGTH - 2])
    if layout.size != size - _PREFIX:  # a key, a tag or headers, or lengths that do not add up
        return None
    (lengths, versions, queues, queue_offsets, store_times, attempts, topic_lengths, id_lengths,
     key_lengths, tag_lengths, header_lengths, body_lengths, topics, ids, bodies) = zip(*map(layout.unpack, payloads))
    if not (lengths.count(size - _PREFIX) == versions.count(codec.VERSION) == queues.count(queue)
            == topic_lengths.count(len(topic)) == topics.count(topic) == id_lengths.count(len(ids[0]))
            == key_lengths.count(0) == tag_lengths.count(0) == header_lengths.count(0)
            == body_lengths.count(len(bodies[0])) == count
            and queue_offsets == tuple(range(first_queue_offset, first_queue_offset + count))):
        return None
    try:
        message_ids = list(map(bytes.decode, ids))
    except _BAD:
        return None
    return RunColumns(message_ids, [""] * count, [""] * count, [NO_HEADERS] * count, list(bodies),
                      store_times, attempts)


@lru_cache(maxsize=256)
def _framing(length: int) -> struct.Struct:
    """A record's magic, CRC and the ``length`` bytes the CRC covers."""
    return struct.Struct(f"{codec.PREFIX.format}{length}s")


@lru_cache(maxsize=256)
def _layout(topic_length: int, id_length: int, body_length: int) -> struct.Struct:
    """The CRC-covered bytes of a record without key, tag or headers: header, topic, id, body."""
    return struct.Struct(f"{codec.HEADER.format}{topic_length}s{id_length}s{body_length}s")


def _heads(data: bytes, starts: Sequence[int], topic_length: int) -> list[tuple[Any, ...]] | None:
    """Each frame's header fields, topic and id, the ids taken as long as the first one (the ids
    of a run mostly have one length: the store's own all have 24 characters); None if a frame
    runs past the data read."""
    try:
        id_length = FRAME.unpack_from(data, starts[0])[_ID_LENGTH] if starts else 0
        return list(map(_frame(topic_length, id_length).unpack_from, repeat(data), starts))
    except struct.error:
        try:  # a shorter id in the last frame
            return list(map(_frame(topic_length, 0).unpack_from, repeat(data), starts))
        except struct.error:
            return None


@lru_cache(maxsize=256)
def _frame(topic_length: int, id_length: int) -> struct.Struct:
    """A frame's prefix and header, its topic and its id, of these lengths, as one struct."""
    return struct.Struct(f"{FRAME.format}{topic_length}s{id_length}s")


def _slices(data: bytes, starts: Iterable[int], ends: Iterable[int]) -> Iterable[bytes]:
    return map(data.__getitem__, map(slice, starts, ends))


def _headers(data: bytes, starts: list[int], ends: list[int]) -> list[Mapping[str, str]]:
    """Each record's headers, decoded once per distinct encoding: records published together
    mostly carry the same headers, which then share one read-only mapping (a run's headers
    compare equal by identity, as a reply's table looks for one value in every row)."""
    encoded = list(_slices(data, starts, ends))
    decoded = {blob: MappingProxyType(msgpack.unpackb(blob, raw=False)) for blob in set(encoded) if blob}
    return [decoded[blob] if blob else NO_HEADERS for blob in encoded]
