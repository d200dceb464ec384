"""Redis Streams entries written by another program (redis-py ``XADD``), not by `reliable`.

A field left out, or bytes that are not text, make one message a dead letter
naming what was wrong; its neighbours are processed, whether the program wrote
at the transport's next id or let Redis choose one (``XADD *``: adopted, see
`test_redis_adoption.py`). Real Redis, and the store on SQLite and on
PostgreSQL (which refuses what it cannot hold).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from reliable import Message
from reliable.testing import test_app

FOREIGN = {
    "no_fields_but_payload": {"payload": b'{"id": "f1"}'},
    "key_not_utf8": {"id": "f2", "payload": b'{"id": "f2"}', "key": b"\xff\xfe\x00k"},
    "headers_not_json": {"id": "f3", "payload": b'{"id": "f3"}', "headers": b"\xc3("},
    "headers_not_text": {"id": "f4", "payload": b'{"id": "f4"}', "headers": b'{"n": 1}'},
    "no_payload": {"id": "f5", "headers": b"{}", "data": b"\x80"},
    "published_at_not_a_number": {"id": "f6", "payload": b'{"id": "f6"}', "published_at": b"soon"},
    "field_name_not_utf8": {"id": "f7", "payload": b'{"id": "f7"}', b"\xff": b"extra"},
}
READABLE = {"no_fields_but_payload", "field_name_not_utf8"}


def _append_foreign(url: str, namespace: str, topic: str, fields: dict, auto_id: bool) -> None:
    """XADD ``fields`` to queue 0 of ``topic`` as a program of its own would: with an id of
    Redis's choosing (``*``), or at the next id, moving the transport's head."""
    client = redis.Redis.from_url(url)
    if auto_id:
        client.xadd(f"{namespace}:stream:{topic}:0", fields)
    else:
        head = int(client.get(f"{namespace}:head:{topic}:0") or 0) + 1
        client.xadd(f"{namespace}:stream:{topic}:0", fields, id=f"0-{head}")
        client.set(f"{namespace}:head:{topic}:0", head)
    client.close()


@pytest.mark.parametrize(("store", "auto_id"), [("sqlite", False), ("postgresql", False), ("sqlite", True)])
def test_foreign_entries_are_processed_or_dead_lettered_and_neighbours_go_on(
    tmp_path: Path, redis_url: str, postgres_url: str, unique: str, store: str, auto_id: bool
) -> None:
    app = test_app(
        tmp_path,
        transport=f"{redis_url}?namespace={unique}&queues=1",
        store=postgres_url if store == "postgresql" else None,
        settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "0"},
    )
    done: list[str] = []

    @app.handler("orders", group=unique)
    def handle(msg: Message, tx) -> None:
        done.append(msg.body["id"])

    app.publish("orders", {"id": "before"})
    for fields in FOREIGN.values():
        _append_foreign(redis_url, unique, "orders", fields, auto_id)
    app.publish("orders", {"id": "after"})
    app.run(until_idle=True)

    assert sorted(done) == sorted(["before", "after", "f1", "f7"])
    letters = {letter.message.offset: letter for letter in app.dead_letters(unique)}
    unreadable = [name for name in FOREIGN if name not in READABLE]
    assert len(letters) == len(unreadable)
    for offset, name in enumerate(FOREIGN, start=1):
        if name in READABLE:
            continue
        letter = letters[offset]
        assert letter.failure.error_type == "backends.errors.UnreadableMessageError", name
        assert "stream entry" in letter.failure.error_message, name
    assert "'key' field is not UTF-8" in letters[2].failure.error_message
    assert "no 'payload' field" in letters[5].failure.error_message
    app.close()
