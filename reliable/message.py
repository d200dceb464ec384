"""Messages as handlers see them.

`Message` is defined in `backends.types` because transports build it; this
module is where users import it from. Bodies are bytes on the wire; ``body``
decodes them (JSON, or msgpack per the ``content-type`` header).
"""

from __future__ import annotations

from backends.types import (
    CONTENT_TYPE,
    JSON,
    MSGPACK,
    DeadLetter,
    Failure,
    Message,
    OutgoingMessage,
    QueueRef,
    decode_body,
    encode_body,
)

REPLAYS_HEADER = "x-reliable-replays"
"""How many times a message was replayed from the dead-letter queue."""

__all__ = [
    "CONTENT_TYPE",
    "JSON",
    "MSGPACK",
    "REPLAYS_HEADER",
    "DeadLetter",
    "Failure",
    "Message",
    "OutgoingMessage",
    "QueueRef",
    "decode_body",
    "encode_body",
]
