"""Decoding a run of frames read with one system call, column by column.

The read-side twin of `prepare`: the frame headers of the whole run are
unpacked with one ``map``, transposed once (``zip(*heads)``), and every check
of `codec.check` (magic, version, length against the consume-queue entry,
queue and queue offset, field lengths, CRC32C) and every field of
`codec.decode` is computed over a whole column, so the per-record work runs
in C rather than in the interpreter loop. If anything is off the run is
refused as a whole (``None``) and the reader decodes it record by record,
which names the bad record.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from operator import add, sub
from types import MappingProxyType
from typing import NamedTuple

import msgpack
from crc32c import crc32c

from broker.store import codec
from broker.store.record import NO_HEADERS

FRAME = struct.Struct("<HI" + codec.HEADER.format.lstrip("<"))  # prefix and header: one unpack
assert FRAME.size == codec.FRAME_MIN
_PREFIX = codec.PREFIX.size
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
    try:
        heads = list(map(FRAME.unpack_from, repeat(data), starts))
    except struct.error:  # a frame runs past the data read
        return None
    (magics, crcs, lengths, versions, queues, queue_offsets, store_times, attempts,
     topic_lengths, id_lengths, key_lengths, tag_lengths, header_lengths, body_lengths) = zip(*heads)
    count = len(heads)
    ends = list(map(add, starts, sizes))
    id_starts = list(map(add, starts, repeat(FRAME.size + len(topic))))
    id_ends = list(map(add, id_starts, id_lengths))
    body_starts = list(map(sub, ends, body_lengths))
    plain = not (any(key_lengths) or any(tag_lengths) or any(header_lengths))
    if plain:  # the field lengths add up: the id ends where the body starts
        header_starts = tag_starts = body_starts
        laid_out = id_ends == body_starts
    else:
        tag_starts = list(map(add, id_ends, key_lengths))
        header_starts = list(map(sub, body_starts, header_lengths))
        laid_out = list(map(add, tag_starts, tag_lengths)) == header_starts
    if not (laid_out and set(magics) == {codec.MAGIC} and set(versions) == {codec.VERSION}
            and set(queues) == {queue} and set(topic_lengths) == {len(topic)}
            and queue_offsets == tuple(range(first_queue_offset, first_queue_offset + count))
            and list(map(_PREFIX.__add__, lengths)) == sizes
            and all(map(data.startswith, repeat(topic), map(sub, id_starts, topic_lengths)))
            and tuple(map(crc32c, map(data.__getitem__, map(slice, map(add, starts, repeat(_PREFIX)),
                                                             ends)))) == crcs):
        return None
    try:
        ids = list(map(bytes.decode, map(data.__getitem__, map(slice, id_starts, id_ends))))
        if plain:
            keys = tags = [""] * count
            headers: Sequence[Mapping[str, str]] = [NO_HEADERS] * count
        else:
            keys = _texts(data, id_ends, tag_starts)
            tags = _texts(data, tag_starts, map(add, tag_starts, tag_lengths))
            headers = _headers(data, header_starts, body_starts)
    except _BAD:
        return None
    bodies = list(map(data.__getitem__, map(slice, body_starts, ends)))
    return RunColumns(ids, keys, tags, headers, bodies, store_times, attempts)


def _texts(data: bytes, starts: Iterable[int], ends: Iterable[int]) -> list[str]:
    return list(map(bytes.decode, map(data.__getitem__, map(slice, starts, ends))))


def _headers(data: bytes, starts: list[int], ends: list[int]) -> list[Mapping[str, str]]:
    return [MappingProxyType(msgpack.unpackb(data[start:end], raw=False)) if start != end else NO_HEADERS
            for start, end in zip(starts, ends)]
