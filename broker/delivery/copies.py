"""The copies a group makes of a delivery: to ``%RETRY%<group>`` (a nack) and ``%DLQ%<group>``
(a dead letter), each naming where the message was first published (kept through every copy)."""

from __future__ import annotations

from broker.delivery.cursor import DELIVER_AT_HEADER, QueueCursor
from broker.delivery.group import (
    DELIVERY_COUNT,
    DLQ_CAUSE,
    ORIGIN_OFFSET,
    ORIGIN_QUEUE,
    ORIGIN_TOPIC,
    dlq_topic,
    retry_topic,
)
from broker.delivery.values import Delivery
from broker.store import Record

MAX_CAUSE = 256
"""Characters of a dead letter's cause its copy keeps: the copy must fit in the headroom its
original left (`broker.store.prepare.COPY_HEADROOM`)."""

Copy = tuple[QueueCursor, int, Record]
"""A copy to append, and the cursor and offset of its original (finished once it is appended)."""


def origin(message: Delivery) -> dict[str, str]:
    """The headers naming where a message was first published (kept through every copy)."""
    headers = dict(message.headers)
    headers.pop(DELIVER_AT_HEADER, None)
    if ORIGIN_TOPIC not in headers:
        headers.update({ORIGIN_TOPIC: message.topic, ORIGIN_QUEUE: str(message.queue),
                        ORIGIN_OFFSET: str(message.offset)})
    return headers


def retry(group: str, message: Delivery, due: float) -> Record:
    """``message``'s copy to ``%RETRY%<group>``, delivered again at ``due``."""
    headers = {**origin(message), DELIVER_AT_HEADER: repr(due)}
    return Record(retry_topic(group), 0, message.body, message.key, message.tag, headers,
                  message.message_id, message.delivery_count)


def dead_letter(group: str, message: Delivery, cause: str) -> Record:
    """``message``'s copy to ``%DLQ%<group>``, with its ``cause`` and delivery count."""
    count = message.delivery_count
    if len(cause) > MAX_CAUSE:
        cause = f"{cause[:MAX_CAUSE - 20]}... [{len(cause) - MAX_CAUSE + 20} cut]"
    headers = {**origin(message), DLQ_CAUSE: cause, DELIVERY_COUNT: str(count)}
    return Record(dlq_topic(group), 0, message.body, message.key, message.tag, headers,
                  message.message_id, count)
