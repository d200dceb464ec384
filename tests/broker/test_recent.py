"""The records just appended, read from memory (`RecentRecords`) and read back from the log alike."""

from __future__ import annotations

import pytest
from storetools import small_config

from broker.errors import BrokerConfigError
from broker.store import MessageStore, Record, StoreConfig
from broker.store.recent import weight


def _batch(count: int, queues: int = 1, **fields: object) -> list[Record]:
    """``count`` records of 50-byte bodies, round robin over ``queues``."""
    return [Record("t", number % queues, f"{number:>10}".encode() * 5, message_id=f"id-{number}",
                   **fields) for number in range(count)]  # type: ignore[arg-type]


def _fields(messages) -> list[tuple]:  # type: ignore[no-untyped-def]
    return [(m.queue_offset, m.log_offset, m.message_id, m.key, m.tag, dict(m.headers), m.body,
             m.store_time, m.attempt) for m in messages]


def test_a_reader_that_keeps_up_gets_the_appended_bodies_themselves(tmp_path) -> None:
    store = MessageStore(tmp_path, small_config())
    records = _batch(40, queues=4)
    store.append(records)
    read = store.read("t", 2, 0, 100)
    assert [m.body for m in read] == [r.body for r in records if r.queue == 2]
    assert all(m.body is r.body for m, r in zip(read, (r for r in records if r.queue == 2)))
    store.close()


def test_what_memory_hands_over_is_what_the_log_holds(tmp_path) -> None:
    """Round robin, keys picked out irregularly, headers, tags and attempts, several batches:
    read from memory, then read again from the log after a restart; the same records."""
    store = MessageStore(tmp_path, small_config(segment_size=1 << 20))
    store.append(_batch(30, queues=3))
    store.append([Record("t", q, f"keyed {n}".encode(), key=f"k{n}", tag="red",
                         headers={"h": str(n)}, attempt=n % 3)
                  for n, q in enumerate([0, 0, 1, 2, 0, 1, 1, 1, 2, 0])])
    store.append(_batch(7))  # store-made ids
    held = {queue: _fields(store.read("t", queue, 0, 100)) for queue in range(3)}
    store.close()
    store = MessageStore(tmp_path, small_config(segment_size=1 << 20))
    assert {queue: _fields(store.read("t", queue, 0, 100)) for queue in range(3)} == held
    assert sum(map(len, held.values())) == 47
    store.close()


def test_headers_changed_after_the_append_are_not_what_is_read(tmp_path) -> None:
    store = MessageStore(tmp_path, small_config())
    headers = {"trace": "a"}
    store.append([Record("t", 0, b"x", headers=headers)])
    headers["trace"] = "changed"
    [message] = store.read("t", 0, 0, 1)
    assert dict(message.headers) == {"trace": "a"}
    store.close()


def test_beyond_the_limit_records_come_from_the_log(tmp_path) -> None:
    """Only the last appends, up to ``recent_bytes`` (framed sizes and objects: `weight`), are
    held: an older batch is read from the log (new objects, equal), and a batch larger than the
    limit is never held."""
    store = MessageStore(tmp_path, small_config(segment_size=1 << 20))
    one = weight([p.size for p in store.append(_batch(10))])  # every batch of 10 weighs as much
    store.close()
    store = MessageStore(tmp_path / "limited", small_config(recent_bytes=2 * one, segment_size=1 << 20))
    first, second = _batch(10), _batch(10)
    store.append(first)
    store.append(second)  # both held
    assert store.read("t", 0, 0, 1)[0].body is first[0].body
    store.append(_batch(10))  # the first is dropped
    old = store.read("t", 0, 0, 10)
    assert old[0].body == first[0].body and old[0].body is not first[0].body
    assert store.read("t", 0, 10, 10)[0].body is second[0].body
    spanning = store.read("t", 0, 5, 10)  # all from the log: memory serves a read whole or not at all
    assert [m.body for m in spanning] == [r.body for r in first[5:] + second[:5]]
    big = _batch(30)
    store.append(big)  # weighs more than the limit: nothing is held
    assert store.read("t", 0, 30, 1)[0].body is not big[0].body
    assert [m.body for m in store.read("t", 0, 30, 30)] == [r.body for r in big]
    store.close()


def test_many_small_appends_let_the_dropped_batches_go(tmp_path) -> None:
    """One record per append, far past the limit: the table keeps at most a third more batches
    than the limit holds (a quarter dropped: copied without them), and reads stay right on
    both sides of the limit."""
    store = MessageStore(tmp_path, small_config(segment_size=1 << 22))
    records = _batch(3000)
    one = weight([store.append([records[0]])[0].size])
    store.close()
    store = MessageStore(tmp_path / "small", small_config(recent_bytes=100 * one, segment_size=1 << 22))
    longest = 0
    for record in records:
        store.append([record])
        starts, batches, dropped = store._recent._table
        longest = max(longest, len(batches))
        assert len(batches) - dropped <= 100 and len(starts) == len(batches)
    assert 100 <= longest <= 134
    assert store.read("t", 0, 2999, 1)[0].body is records[2999].body  # held
    assert [m.body for m in store.read("t", 0, 0, 3000)] == [r.body for r in records]  # the log
    store.close()


def test_none_held_when_recent_bytes_is_zero(tmp_path) -> None:
    store = MessageStore(tmp_path, small_config(recent_bytes=0))
    records = _batch(3)
    store.append(records)
    assert [m.body for m in store.read("t", 0, 0, 3)] == [r.body for r in records]
    assert store.read("t", 0, 0, 1)[0].body is not records[0].body
    store.close()


def test_under_sync_memory_shows_only_what_an_fsync_covered(tmp_path) -> None:
    store = MessageStore(tmp_path, small_config(flush="sync"))
    records = _batch(5)
    store.append(records)  # returns after its fsync
    assert [m.body for m in store.read("t", 0, 0, 5)] == [r.body for r in records]
    store._visible = 0  # as if the next append were written and not yet fsynced
    assert store.read("t", 0, 0, 5) == []
    store.close()


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(BrokerConfigError, match="recent_bytes"):
        StoreConfig(recent_bytes=-1)
