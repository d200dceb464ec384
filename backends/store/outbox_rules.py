"""What ``tx.publish`` accepts: the checks of one call, before its outbox row is made.

"Text" is what every store's column holds as it is (`backends.types.storable`):
no NUL, and no byte that was not UTF-8 (a binary Kafka key passed on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from backends.errors import OutboxMessageError
from backends.types import not_text, storable

MESSAGE_ID_MAX = 64  # the column's width
TOPIC_MAX, KEY_MAX = 255, 512  # the columns' widths: PostgreSQL refuses more at the commit, SQLite does not


def check_publish(topic: Any, key: Any, headers: Any, delay: Any, message_id: Any = None) -> None:
    """An `OutboxMessageError` naming what ``tx.publish(topic, key=..., ...)`` got wrong: what its
    row's columns cannot hold on every store (PostgreSQL refuses at the commit what SQLite
    keeps) or the relay could not send."""
    where = f"tx.publish to {topic!r}"
    if message_id is not None and not (
        isinstance(message_id, str) and 0 < len(message_id) <= MESSAGE_ID_MAX and storable(message_id)
    ):
        raise OutboxMessageError(f"{where}: message_id={message_id!r} must be 1 to {MESSAGE_ID_MAX} characters of text, "
                                 "no NUL")
    if not isinstance(topic, str) or not 0 < len(topic) <= TOPIC_MAX or topic.startswith("%") or not storable(topic):
        raise OutboxMessageError(f"{where}: topic must be 1 to {TOPIC_MAX} characters of text, no NUL, "
                                 "not starting with '%'")
    if key is not None and not (isinstance(key, str) and len(key) <= KEY_MAX and storable(key)):
        raise OutboxMessageError(f"{where}: key={key!r} must be None or at most {KEY_MAX} characters of text, "
                                 "no NUL")
    if headers is not None and not (
        isinstance(headers, Mapping)
        and all(isinstance(k, str) and not not_text(k) and isinstance(v, str) for k, v in headers.items())
    ):
        raise OutboxMessageError(f"{where}: headers={headers!r} must map strings to strings, names with a "
                                 "UTF-8 form (no transport carries a lone surrogate in a header name)")
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay) or delay < 0:
        raise OutboxMessageError(f"{where}: delay={delay!r} must be a number of seconds >= 0")
