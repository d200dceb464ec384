"""Messages ready again in a group that emptied, or parked and now due, read from the store again.

A group whose members all left keeps its cursors (a group is never deleted), and kept whatever
its members had been handed and not acknowledged, bodies and all, in memory: a client joining a
new group, fetching its window's worth and leaving pinned that much per group, ``max_groups``
times over. An empty group now keeps their offsets and delivery counts only (`QueueCursor.spill`);
a fetch reads what it may hand out back from the store first. A parked message (scheduled, or
retried in place after a delay) is kept so too until due. One that retention removed meanwhile
is done (as a gap a fetch skips).
"""

from __future__ import annotations

from itertools import groupby

from broker.delivery.cursor import DELIVER_AT_HEADER, QueueCursor
from broker.delivery.values import Delivery
from broker.store import MessageStore
from broker.store.record import StoredMessage


def reload(store: MessageStore, cursor: QueueCursor, count: int) -> None:
    """The lowest ``count`` of ``cursor``'s spilled messages are ready again, read from the store."""
    if not cursor.spilled:
        return
    wanted = cursor.spilled.take(count)
    for _, run in groupby(enumerate(wanted), lambda pair: pair[1][0] - pair[0]):  # consecutive offsets
        entries = [entry for _, entry in run]
        batch = store.read_batch(cursor.topic, cursor.queue, entries[0][0], max_count=len(entries))
        found = {message.queue_offset: message for message in batch.messages()}
        for offset, delivered in entries:
            message = found.get(offset)
            if message is None:  # retention removed it meanwhile
                cursor.finish(offset)
            else:
                cursor.ready[offset] = _delivery(message, delivered)


def _delivery(message: StoredMessage, delivered: int) -> Delivery:
    headers = message.headers
    if DELIVER_AT_HEADER in headers:  # delivered once: it was due
        headers = {name: value for name, value in headers.items() if name != DELIVER_AT_HEADER}
    return Delivery("", message.topic, message.queue, message.queue_offset, message.message_id,
                    message.body, message.key, message.tag, headers, delivered, message.store_time)
