"""`Taken`: what one fetch hands out, counted in deliveries and in bytes (`broker.delivery.sizes`).

A fetch may hand out at most ``max_fetch_bytes`` of messages, and no more than the
member's byte window leaves room for (``max_unacked_bytes`` on the server); the
first message is handed out whatever its size, so a message larger than either
still goes out, alone.
"""

from __future__ import annotations

from broker.delivery.cursor import QueueCursor
from broker.delivery.sizes import delivery_size
from broker.delivery.values import Delivery, DeliveryColumns


class Taken:
    """The parts a fetch hands out, how many deliveries they hold, and the bytes of messages it may
    still hand out (``max_bytes``: of ``max_fetch_bytes`` and the byte window's room, the less),
    read from the store or ready again; the first message goes out whatever its size."""

    def __init__(self, max_bytes: int) -> None:
        self.parts: list[DeliveryColumns] = []
        self.count = 0
        self.max_bytes, self.bytes_read = max_bytes, 0

    @property
    def full(self) -> bool:
        return self.bytes_read >= self.max_bytes

    def again(self, cursor: QueueCursor, count: int) -> list[Delivery]:
        """Up to ``count`` of ``cursor``'s messages ready again, the lowest offsets first, within the
        bytes left (one at least, if nothing was taken yet): taken out of ``cursor.ready``."""
        chosen: list[Delivery] = []
        for offset in sorted(cursor.ready)[:count]:
            size = delivery_size(cursor.ready[offset])
            if self.bytes_read and self.bytes_read + size > self.max_bytes:
                break
            chosen.append(cursor.ready.pop(offset))
            self.bytes_read += size
        return chosen

    def add(self, part: DeliveryColumns) -> None:
        if part.count:
            self.parts.append(part)
            self.count += part.count

    def __len__(self) -> int:
        return self.count
