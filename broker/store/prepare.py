"""Validating and encoding a `Record`'s fields before the writer lock is taken."""

from __future__ import annotations

from typing import NamedTuple

from broker.errors import InvalidRecordError, RecordTooLargeError
from broker.store import codec
from broker.store.queues import check_place, tag_hash
from broker.store.record import Record

GENERATED_ID_LENGTH = 24
_checked_topics: dict[str, bytes] = {}


class Prepared(NamedTuple):
    """A record's fields, validated and encoded to bytes."""

    topic: str
    topic_b: bytes
    queue: int
    message_id: str
    key: bytes
    tag: bytes
    headers: bytes
    body: bytes
    attempt: int
    tag_hash: int


def prepare(record: Record, max_record_size: int) -> Prepared:
    """Validate ``record`` and encode its fields; raise a clear error naming what is wrong."""
    topic_b = _checked_topics.get(record.topic) if type(record.topic) is str else None
    if topic_b is None or not isinstance(record.queue, int) or not 0 <= record.queue <= 65_535:
        check_place(record.topic, record.queue)
        topic_b = _checked_topics.setdefault(record.topic, record.topic.encode())
    body = record.body
    if type(body) is not bytes:
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise InvalidRecordError(f"body of a record for {record.topic} must be bytes, "
                                     f"not {type(body).__name__}")
        body = bytes(body)
    try:
        key, tag = record.key.encode(), record.tag.encode()
        headers = codec.encode_headers(record.headers)
        id_length = len(record.message_id.encode()) or GENERATED_ID_LENGTH
    except (AttributeError, TypeError, UnicodeEncodeError, ValueError) as exc:
        raise InvalidRecordError(f"record for {record.topic}: bad key, tag, id or headers: "
                                 f"{exc}") from exc
    if max(len(key), len(tag), id_length) > 65_535:
        raise InvalidRecordError(f"record for {record.topic}: key, tag and message id must be "
                                 "at most 65535 bytes")
    if not isinstance(record.attempt, int) or not 0 <= record.attempt < 2**32:
        raise InvalidRecordError(f"attempt={record.attempt!r} must be an integer 0..2**32-1")
    size = codec.FRAME_MIN + len(topic_b) + id_length + len(key) + len(tag) + len(headers) + len(body)
    if size > max_record_size:
        raise RecordTooLargeError(f"record for {record.topic} is {size} bytes framed, above "
                                  f"max_record_size={max_record_size}")
    return Prepared(record.topic, topic_b, record.queue, record.message_id, key, tag, headers,
                    body, record.attempt, tag_hash(record.tag))
