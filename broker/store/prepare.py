"""Validating and encoding a `Record`'s fields before the writer lock is taken.

Everything that does not depend on the record's place in the log (its queue
offset, log offset, store time, generated id) is encoded here, so the writer's
loop only packs a header, joins three byte strings and computes a CRC.
"""

from __future__ import annotations

from crc32c import crc32c

from broker.errors import InvalidRecordError, RecordTooLargeError
from broker.store import codec
from broker.store.queues import check_place
from broker.store.record import Record

GENERATED_ID_LENGTH = 24
MAX_FIELD = 65_535
_HEADER_SIZE, _PREFIX_SIZE = codec.HEADER.size, codec.PREFIX.size
_topics: dict[str, bytes] = {}

Prepared = tuple[str, bytes, int, str, bytes, bytes, int, int, int, int, int, int, int]
"""(topic, topic bytes, queue, message id, id bytes, key+tag+headers+body, attempt,
len(key), len(tag), len(headers), len(body), fixed length, tag hash)."""


def prepare(record: Record, max_record_size: int) -> Prepared:
    """Validate ``record`` and encode its fields; raise a clear error naming what is wrong."""
    topic, queue, body = record.topic, record.queue, record.body
    topic_b = _topics.get(topic) if type(topic) is str else None
    if topic_b is None or type(queue) is not int or not 0 <= queue <= MAX_FIELD:
        check_place(topic, queue)
        topic_b = _topics.setdefault(topic, topic.encode())
    if type(body) is not bytes:
        if not isinstance(body, (bytearray, memoryview)):
            raise InvalidRecordError(f"body of a record for {topic} must be bytes, "
                                     f"not {type(body).__name__}")
        body = bytes(body)
    try:
        key, tag, message_id = record.key.encode(), record.tag.encode(), record.message_id.encode()
        headers = codec.encode_headers(record.headers) if record.headers else b""
    except (AttributeError, TypeError, UnicodeEncodeError, ValueError) as exc:
        raise InvalidRecordError(f"record for {topic}: bad key, tag, id or headers: {exc}") from exc
    key_length, tag_length, id_length = len(key), len(tag), len(message_id)
    if key_length > MAX_FIELD or tag_length > MAX_FIELD or id_length > MAX_FIELD:
        raise InvalidRecordError(f"record for {topic}: key, tag and message id must be at most "
                                 f"{MAX_FIELD} bytes")
    attempt = record.attempt
    if type(attempt) is not int or not 0 <= attempt < 2**32:
        raise InvalidRecordError(f"attempt={attempt!r} must be an integer 0..2**32-1")
    headers_length, body_length = len(headers), len(body)
    fixed = (_HEADER_SIZE + len(topic_b) + key_length + tag_length + headers_length
             + body_length)
    size = _PREFIX_SIZE + fixed + (id_length or GENERATED_ID_LENGTH)
    if size > max_record_size:
        raise RecordTooLargeError(f"record for {topic} is {size} bytes framed, above "
                                  f"max_record_size={max_record_size}")
    return (topic, topic_b, queue, record.message_id, message_id, key + tag + headers + body,
            attempt, key_length, tag_length, headers_length, body_length, fixed,
            crc32c(tag) if tag_length else 0)
