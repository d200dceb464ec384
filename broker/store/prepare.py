"""Validating and encoding a batch of records (`RecordColumns`) before the writer lock is taken.

Everything that does not depend on the records' place in the log (queue
offsets, log offsets, store time, generated ids) is encoded here, column by
column: every field is checked and encoded with ``map`` over a whole column,
so the per-record work runs in C rather than in the interpreter loop. The
rare bad record is then found by a per-record pass that names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from types import MappingProxyType
from typing import NamedTuple

from crc32c import crc32c

from broker.errors import InvalidRecordError, RecordTooLargeError
from broker.store import codec
from broker.store.keyindex import ID_SEED, topic_seed
from broker.store.queues import check_place
from broker.store.record import NO_HEADERS, RecordColumns

GENERATED_ID_LENGTH = 24
COPY_TOPICS = ("%RETRY%", "%DLQ%")
"""The topics the delivery layer writes copies to (a nack's retry, a dead letter): each copy is
its original with a few headers more and a topic name of its own."""
COPY_HEADROOM = 2048
"""Bytes of ``max_record_size`` (an eighth, where that is less) that a record of any other topic
leaves for its copies: the origin headers (a topic name of up to 200 characters), a delivery
count, a due time, a dead-letter cause (cut to `broker.delivery.copies.MAX_CAUSE` characters)
and the copy topic's name. A copy the store refused made the nack fail, and a fetch whose sweep
dead-lettered an expired lease failed for every member of the group, again at every fetch."""
MAX_FIELD = 65_535
MAX_ATTEMPT = 2**32 - 1
_FRAME_MIN = codec.FRAME_MIN
_topics: dict[str, bytes] = {}


class Prepared(NamedTuple):
    """A validated batch, one list (column) per field, in batch order.

    ``ids`` holds the id bytes, with ``b""`` where the store makes the id;
    ``generated`` says whether any record needs one. ``key_hashes`` /
    ``id_hashes`` are the key-index hashes of the records ``keyed`` /
    ``named`` select (``named``: producer-given ids, but for those that continue a
    batch run, `broker.store.runs`).
    """

    topics: Sequence[str]
    queues: Sequence[int]
    message_ids: Sequence[str]
    attempts: Sequence[int]
    topics_b: list[bytes]
    ids: list[bytes]
    keys: list[bytes]
    tags: list[bytes]
    headers: list[bytes]
    bodies: Sequence[bytes]
    topic_lengths: list[int]
    key_lengths: list[int]
    tag_lengths: list[int]
    header_lengths: list[int]
    body_lengths: list[int]
    lengths: list[int]  # the frame's length field: header through body
    sizes: list[int]  # the framed size in the log
    tag_hashes: list[int]
    generated: bool
    keyed: list[bool]
    key_hashes: list[int]
    named: list[bool]
    id_hashes: list[int]
    key_texts: Sequence[str]  # the keys, tags and headers as given (what readers get back)
    tag_texts: Sequence[str]
    header_maps: Sequence[Mapping[str, str]]  # each an immutable copy


def copy_headroom(max_record_size: int) -> int:
    """Bytes a record outside `COPY_TOPICS` leaves of ``max_record_size`` for its copies."""
    return min(COPY_HEADROOM, max_record_size // 8)


def _check_sizes(sizes: Sequence[int], topics: Sequence[str], max_record_size: int) -> None:
    """A `RecordTooLargeError` for the first record above ``max_record_size``, less the headroom
    of its copies where it is an original."""
    headroom = copy_headroom(max_record_size)
    for size, topic in zip(sizes, topics, strict=True):
        if size > max_record_size:
            raise RecordTooLargeError(f"record for {topic} is {size} bytes framed, above "
                                      f"max_record_size={max_record_size}")
        if size > max_record_size - headroom and not topic.startswith(COPY_TOPICS):
            raise RecordTooLargeError(
                f"record for {topic} is {size} bytes framed, above max_record_size={max_record_size} less the "
                f"{headroom} bytes kept for the headers of its retry and dead-letter copies")


def prepare(records: RecordColumns, max_record_size: int) -> Prepared:
    """Validate ``records`` and encode their fields; raise a clear error naming what is wrong."""
    if (not isinstance(records, RecordColumns) or len(set(map(len, records[:-1]))) != 1
            or not records.length or len(records.continues) not in (0, records.length)):
        raise InvalidRecordError("append takes records, every field a column of one length")
    topics, queues, bodies, keys, tags, headers, message_ids, attempts, continues = records
    topics_b = _topic_bytes(topics, queues)
    bodies = _bodies(topics, bodies)
    if not _all_in_range(attempts, MAX_ATTEMPT):
        bad = next(a for a in attempts if type(a) is not int or not 0 <= a <= MAX_ATTEMPT)
        raise InvalidRecordError(f"attempt={bad!r} must be an integer 0..2**32-1")
    try:
        (keys_b, key_lengths), (tags_b, tag_lengths), (ids_b, id_lengths) = (
            _encode(keys), _encode(tags), _encode(message_ids))
        if any(headers):
            headers_b = [codec.encode_headers(h) if h else b"" for h in headers]
            header_maps = [MappingProxyType(dict(h)) if h else NO_HEADERS for h in headers]
        else:
            headers_b, header_maps = [b""] * len(headers), [NO_HEADERS] * len(headers)
    except (AttributeError, TypeError, UnicodeEncodeError, ValueError) as exc:
        raise InvalidRecordError(f"record for {topics[0]}: bad key, tag, id or headers: {exc}") from exc
    generated = not all(id_lengths)
    if max(key_lengths) > MAX_FIELD or max(tag_lengths) > MAX_FIELD or max(id_lengths) > MAX_FIELD:
        raise InvalidRecordError(f"record for {topics[0]}: key, tag and message id must be at "
                                 f"most {MAX_FIELD} bytes")
    if generated:
        id_lengths = [n or GENERATED_ID_LENGTH for n in id_lengths]
    topic_lengths = list(map(len, topics_b))
    header_lengths, body_lengths = list(map(len, headers_b)), list(map(len, bodies))
    lengths = _sums(codec.HEADER.size, topic_lengths, id_lengths, key_lengths, tag_lengths,
                    header_lengths, body_lengths)
    sizes = list(map(codec.PREFIX.size.__add__, lengths))
    if max(sizes) > max_record_size - copy_headroom(max_record_size):
        _check_sizes(sizes, topics, max_record_size)
    keyed = list(map(bool, key_lengths)) if any(key_lengths) else [False] * len(key_lengths)
    named = ([True] * len(ids_b) if not generated
             else list(map(bool, ids_b)) if any(ids_b) else [False] * len(ids_b))
    if any(continues):  # a batch run's ids after its first: found by reading on from it
        named = list(map(bool.__gt__, named, map(bool, continues)))
    seeds = map({t: topic_seed(t) for t in set(topics_b)}.__getitem__, compress(topics_b, keyed))
    return Prepared(
        topics, queues, message_ids, attempts, topics_b, ids_b, keys_b, tags_b, headers_b,
        bodies, topic_lengths, key_lengths, tag_lengths, header_lengths, body_lengths,
        lengths, sizes,
        [crc32c(tag) if tag else 0 for tag in tags_b] if any(tag_lengths) else [0] * len(tags_b),
        generated, keyed, list(map(crc32c, compress(keys_b, keyed), seeds)),
        named, list(map(crc32c, compress(ids_b, named), repeat(ID_SEED))),  # id_hash of each
        keys, tags, header_maps,
    )


def _topic_bytes(topics: Sequence[str], queues: Sequence[int]) -> list[bytes]:
    """The encoded topic of every record, after checking every topic and queue."""
    known = _topics.get
    single = topics.count(topics[0]) == len(topics)  # the usual batch: one topic
    if (set(map(type, queues)) != {int} or min(queues) < 0 or max(queues) > MAX_FIELD
            or (known(topics[0]) is None if single else None in map(known, topics))):
        for topic, queue in zip(topics, queues):
            check_place(topic, queue)
            _topics.setdefault(topic, topic.encode())
    return [_topics[topics[0]]] * len(topics) if single else list(map(_topics.__getitem__, topics))


def _bodies(topics: Sequence[str], bodies: Sequence[bytes]) -> Sequence[bytes]:
    """The bodies as ``bytes`` (a bytearray or memoryview is copied; anything else rejected)."""
    if set(map(type, bodies)) == {bytes}:
        return bodies
    converted = []
    for topic, body in zip(topics, bodies):
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise InvalidRecordError(f"body of a record for {topic} must be bytes, "
                                     f"not {type(body).__name__}")
        converted.append(bytes(body))
    return tuple(converted)


def _all_in_range(values: Sequence[int], maximum: int) -> bool:
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= maximum


def _encode(texts: Sequence[str]) -> tuple[list[bytes], list[int]]:
    """UTF-8 of every text and its length (``TypeError`` if one is not a str); a column of
    empty texts (the usual keys, tags and ids) is answered without a pass per text."""
    if texts.count("") == len(texts):
        return [b""] * len(texts), [0] * len(texts)
    encoded = list(map(str.encode, texts))
    return encoded, list(map(len, encoded))


def _sums(start: int, *columns: list[int]) -> list[int]:
    """``start`` plus the sum of ``columns`` at every position; columns of one repeated value
    (most of a batch's lengths) are added once, not per record."""
    varying = []
    for column in columns:
        if column.count(column[0]) == len(column):
            start += column[0]
        else:
            varying.append(column)
    if not varying:
        return [start] * len(columns[0])
    if len(varying) == 1:
        return list(map(start.__add__, varying[0]))
    return list(map(start.__add__, map(sum, zip(*varying))))
