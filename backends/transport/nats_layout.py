"""Where `nats://` keeps things in JetStream: streams, subjects, consumers, headers.

A topic ``orders`` read by group ``billing``, in namespace ``reliable``:

=================================  ===============================================
stream ``reliable_T_orders``       subjects ``reliable.t.orders`` and
                                   ``reliable.t.orders.>``, limits retention
subject ``reliable.t.orders``      the messages as published; every group reads it
subject ``reliable.t.orders.g.billing``
                                   ``publish_to_group``: read by ``billing`` alone
consumer ``m_billing``             durable pull consumer of ``billing`` on the
                                   published messages (members share its work)
consumer ``r_billing``             the same on the group's own subject
stream ``reliable_DLQ_billing``    subject ``reliable.dlq.billing``: POISON
                                   messages with their failure
=================================  ===============================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from backends.errors import ConfigurationError, TransportError
from backends.transport.base import (
    DUE_HEADER,
    ID_HEADER,
    KEY_HEADER,
    ORIGIN_TOPIC_HEADER,
    Capabilities,
)
from backends.types import Message

CAPABILITIES = Capabilities(consumer_offsets=False, drain=True, native_delay=True, dead_letter_queue=True)

MSG_ID_HEADER = "Nats-Msg-Id"
"""JetStream's de-duplication id: a second publish within the stream's duplicate window is dropped."""
INTERNAL_HEADERS = frozenset({ID_HEADER, KEY_HEADER, DUE_HEADER, MSG_ID_HEADER})

_LEGAL = re.compile(r"[A-Za-z0-9_-]+")
MAX_NAME_LENGTH = 200


def check_nats_name(kind: str, name: str) -> None:
    """A `TransportError` unless ``name`` is a legal subject token and stream/consumer name part."""
    if not _LEGAL.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
        raise TransportError(
            f"{kind} name {name!r}: nats:// allows letters, digits, '_' and '-' "
            f"(at most {MAX_NAME_LENGTH} characters)"
        )


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name nats-py sends (RFC 7230's token characters)."""
MAX_HEADER_BYTES = 64 * 1024
"""JetStream refuses a message whose header block is larger (error 10097)."""


def check_nats_message(headers: Mapping[str, str], payload: int, max_payload: int) -> None:
    """A `TransportError` for a message NATS would refuse or change in silence: a header name
    nats-py refuses or skips (empty), a value it would trim or whose line breaks it would turn
    into spaces, more headers than JetStream takes (it answers with no ack: a timeout), or headers
    and ``payload`` bytes together above the server's ``max_payload`` (it closes the connection).
    Both of the last would be taken for an outage and retried for ever."""
    size = len(b"NATS/1.0\r\n\r\n")
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise TransportError(f"header name {name!r}: nats:// carries names of ASCII letters, digits and "
                                 "!#$%&'*+-.^_`|~ only")
        if value != value.strip() or "\r" in value or "\n" in value:
            raise TransportError(f"header {name!r} value {value[:60]!r}: nats:// cannot carry spaces at either "
                                 "end or line breaks (nats-py would trim them or turn them into spaces)")
        size += len(name) + len(value.encode("utf-8", "surrogateescape")) + 4
    if size > MAX_HEADER_BYTES:
        raise TransportError(f"headers of {size} bytes: JetStream takes at most {MAX_HEADER_BYTES} bytes of "
                             "headers per message; send large values in the body")
    if size + payload > max_payload:
        raise TransportError(f"message of {payload} bytes with {size} bytes of headers: above the NATS "
                             f"server's max_payload={max_payload}")


def one_line(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` as nats-py sends them (values trimmed, line breaks turned into spaces), said
    here: a dead letter's traceback is read as one line."""
    return {name: value.strip().replace("\r", " ").replace("\n", " ") for name, value in headers.items()}


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _LEGAL.fullmatch(namespace):
        raise ConfigurationError(
            f"transport option namespace={namespace!r}: letters, digits, '_' and '-' only"
        )
    return namespace


class Layout:
    """The JetStream names of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = check_namespace(namespace)

    def stream(self, topic: str) -> str:
        return f"{self.namespace}_T_{topic}"

    def subject(self, topic: str) -> str:
        return f"{self.namespace}.t.{topic}"

    def stream_subjects(self, topic: str) -> list[str]:
        return [self.subject(topic), f"{self.subject(topic)}.>"]

    def group_subject(self, topic: str, group: str) -> str:
        return f"{self.subject(topic)}.g.{group}"

    def dead_letter_stream(self, group: str) -> str:
        return f"{self.namespace}_DLQ_{group}"

    def dead_letter_subject(self, group: str) -> str:
        return f"{self.namespace}.dlq.{group}"

    @staticmethod
    def consumers(group: str) -> tuple[str, str]:
        """The group's durable consumers of a topic stream: published messages, its own subject."""
        return f"m_{group}", f"r_{group}"


def due_at(headers: Mapping[str, str]) -> float:
    """When a delayed publish falls due (0: at once)."""
    try:
        return float(headers.get(DUE_HEADER, 0) or 0)
    except ValueError:
        return 0.0


def to_message(
    topic: str, sequence: int, payload: bytes, headers: Mapping[str, str], delivered: int,
    published_at: float, receipt: str,
) -> Message:
    """A delivered `Message`: internal headers become its fields, the stream sequence its offset.

    ``attempt`` is JetStream's delivery count; a delayed publish is handed out
    once early and nak'ed until due, a delivery it does not count.
    """
    deferred = 1 if DUE_HEADER in headers and delivered > 1 else 0
    return Message(
        id=_faithful(headers.get(ID_HEADER) or headers.get(MSG_ID_HEADER)) or f"{topic}-{sequence}",
        topic=headers.get(ORIGIN_TOPIC_HEADER, topic),
        queue=0,
        offset=sequence,
        payload=payload,
        key=headers.get(KEY_HEADER),
        headers={name: value for name, value in headers.items() if name not in INTERNAL_HEADERS},
        attempt=delivered - deferred,
        published_at=published_at,
        receipt=receipt,
    )


def _faithful(message_id: str | None) -> str | None:
    """``message_id`` unless it holds U+FFFD: nats-py reads bytes that are not UTF-8 as that
    character, so two different ids another program sent would read the same (and the second
    be taken for a duplicate of the first); such a message is named by its stream sequence."""
    return None if message_id is None or "\ufffd" in message_id else message_id
