"""The Redis Streams transport's Lua scripts under ``maxmemory`` (``noeviction``): all or nothing.

Redis refuses a script's write with ``OOM`` only while the script has written nothing yet (it
cannot stop one half way), so a script that runs into ``OOM`` has changed nothing, unless it
catches the refusal (``redis.pcall``) and writes on: a later write that does not grow memory
(``XDEL``, ``ZREM``, ``HDEL``) counts as the script's first, and every write after it passes.
``append`` (``PUBLISH``, and ``CLAIM`` moving due delayed messages) caught a refused ``XADD`` as
the sign of another program's entry to adopt, and ``CLAIM`` caught a refused ``XGROUP CREATE``
as "the group exists"; each now raises ``OOM`` itself before anything else. A publish stored its
delayed messages by commands of their own before its script: it is one script now. A server of
the test's own, its ``maxmemory`` lowered under what it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs

from backends.clock import FakeClock
from backends.errors import WritesRefusedError
from backends.transport import redis_layout as layout
from backends.transport.redis_streams import RedisStreamsTransport
from backends.types import Failure, OutgoingMessage
from tests.transports.test_redis_server_events import RedisServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    started = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    started.start()
    yield started
    started.stop()


def out_of_memory(admin: redis.Redis) -> None:
    """``maxmemory`` under what the server holds: every write that grows memory is refused."""
    admin.set("ballast", b"x" * 3_000_000)
    admin.config_set("maxmemory", "1mb")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        admin.set("probe", b"x")


def snapshot(admin: redis.Redis) -> dict[bytes, object]:
    """Every key of the transport's namespace with what it holds."""
    held: dict[bytes, object] = {}
    for key in sorted(admin.keys("t:*")):
        kind = admin.type(key)
        held[key] = {b"stream": lambda k: (admin.xrange(k), admin.xinfo_stream(k)["last-generated-id"]),
                     b"string": admin.get, b"hash": admin.hgetall,
                     b"zset": lambda k: admin.zrange(k, 0, -1, withscores=True)}[kind](key)
    return held


def test_a_new_groups_first_fetch_under_oom_changes_nothing(server: RedisServer) -> None:
    """A queue holding another program's entry, a group's first fetch: the old ``CLAIM`` caught
    ``XGROUP CREATE``'s ``OOM``, adopted the entry (its ``XDEL`` let every later write pass),
    marked the group as joined, then failed on the group it had not made (``NOGROUP``: a
    refusal for good, which ends a worker's run); the next fetch took the group for one deleted
    under it and logged ``transport.group_recreated``."""
    admin = redis.Redis.from_url(server.url)
    transport = RedisStreamsTransport(server.url, FakeClock(), namespace="t", queues=1)
    keys = layout.Keys("t")
    try:
        transport.publish("orders", [OutgoingMessage(b"{}", message_id="m1")])
        admin.xadd(keys.stream("orders", 0), {"id": "foreign", "payload": b"{}"})  # an id of its own
        member = transport.subscribe("shipping", ["orders"])
        out_of_memory(admin)
        before = snapshot(admin)
        with pytest.raises(WritesRefusedError, match="maxmemory"):
            member.fetch(10, 0)
        assert snapshot(admin) == before
        admin.config_set("maxmemory", "0")
        with capture_logs() as logs:
            assert sorted(m.id for m in member.fetch(10, 0)) == ["foreign", "m1"]
        assert not [e for e in logs if e["event"] == "transport.group_recreated"]
        member.close()
    finally:
        admin.config_set("maxmemory", "0")
        transport.purge()
        transport.close()
        admin.close()


def test_a_publish_under_oom_changes_nothing_and_adopts_nothing(server: RedisServer) -> None:
    """The old ``append`` took its ``XADD``'s ``OOM`` for another program's entry above the head
    and adopted: the adoption's ``XDEL`` let every later write pass, so the publish went through
    past ``maxmemory`` (where it came first, any other write is refused)."""
    admin = redis.Redis.from_url(server.url)
    transport = RedisStreamsTransport(server.url, FakeClock(), namespace="t", queues=1)
    keys = layout.Keys("t")
    try:
        transport.publish("orders", [OutgoingMessage(b"{}", message_id="m1")])
        admin.xadd(keys.stream("orders", 0), {"id": "foreign", "payload": b"{}"})
        out_of_memory(admin)
        before = snapshot(admin)
        with capture_logs() as logs, pytest.raises(WritesRefusedError, match="maxmemory"):
            transport.publish("orders", [OutgoingMessage(b"{}", message_id=f"m{n}") for n in (2, 3)])
        assert snapshot(admin) == before  # the foreign entry not moved, nothing appended
        assert not [e for e in logs if e["event"] == "transport.foreign_entries_adopted"]
        admin.config_set("maxmemory", "0")
        transport.publish("orders", [OutgoingMessage(b"{}", message_id=f"m{n}") for n in (2, 3)])
        member = transport.subscribe("shipping", ["orders"])
        assert [m.id for m in member.fetch(10, 0)] == ["m1", "foreign", "m2", "m3"]
        member.close()
    finally:
        admin.config_set("maxmemory", "0")
        transport.purge()
        transport.close()
        admin.close()


def test_a_nack_and_a_dead_letter_under_oom_go_through_whole(server: RedisServer) -> None:
    """``NACK`` and ``DEAD_LETTER`` start with a ``ZREM`` (a write that does not grow memory), so
    Redis lets the rest of each pass out of memory: the message is scheduled, or in the
    dead-letter stream, never out of its lease and nowhere."""
    admin = redis.Redis.from_url(server.url)
    clock = FakeClock()
    transport = RedisStreamsTransport(server.url, clock, namespace="t", queues=1)
    try:
        transport.publish("orders", [OutgoingMessage(b"{}", message_id=f"m{n}") for n in (1, 2)])
        member = transport.subscribe("shipping", ["orders"])
        first, second = member.fetch(10, 0)
        out_of_memory(admin)
        member.nack(first, 5.0)
        member.dead_letter(second, Failure("ValueError", "bad", "Traceback ...", 1, 1.0, 2.0))
        admin.config_set("maxmemory", "0")
        assert [m.id for m in transport.dead_letter_queue("shipping")] == ["m2"]
        clock.advance(transport.visibility_timeout + 1)  # past the nack's delay and any lease
        assert [(m.id, m.attempt) for m in member.fetch(10, 0)] == [("m1", 2)]
        member.close()
    finally:
        admin.config_set("maxmemory", "0")
        transport.purge()
        transport.close()
        admin.close()


@pytest.mark.parametrize("delayed_first", [True, False], ids=["delayed-first", "ready-first"])
def test_a_publish_refused_out_of_memory_stores_no_part_of_it(server: RedisServer, delayed_first: bool) -> None:
    """A delayed message and a large ready one, published together: the large one's argument takes
    Redis past ``maxmemory`` only once it is read. The old ``_append`` stored the delayed message
    first (its own ``INCR``, then a ``MULTI``, both under the limit) and then had its ``PUBLISH``
    script refused with ``OOM``; the caller's retry stored the delayed message again, a twin under
    the same id that was delivered twice. Now one script: refused at its first write, or whole."""
    admin = redis.Redis.from_url(server.url)
    clock = FakeClock()
    transport = RedisStreamsTransport(server.url, clock, namespace="t", queues=1)
    keys = layout.Keys("t")
    later = OutgoingMessage(b"{}", message_id="later", delay=5.0)
    large = OutgoingMessage(b"x" * 2_000_000, message_id="large")
    batch = [later, large] if delayed_first else [large, later]
    try:
        transport.publish("orders", [OutgoingMessage(b"{}", message_id="m1")])
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] + 1_000_000)
        admin.set("probe", b"x")  # under the limit: a small write passes, a 2 MB one does not
        before = snapshot(admin)
        with pytest.raises(WritesRefusedError, match="maxmemory"):
            transport.publish("orders", batch)
        assert snapshot(admin) == before  # old: the delayed message's hash and its due time stored
        admin.config_set("maxmemory", "0")
        transport.publish("orders", batch)  # the caller's retry
        assert admin.zcard(keys.delayed("orders")) == 1
        clock.advance(later.delay)
        member = transport.subscribe("shipping", ["orders"])
        assert sorted(m.id for m in member.fetch(10, 0)) == ["large", "later", "m1"]
        member.close()
    finally:
        admin.config_set("maxmemory", "0")
        transport.purge()
        transport.close()
        admin.close()
