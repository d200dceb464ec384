"""The record frame: round trip, and every kind of damage detected."""

from __future__ import annotations

import pytest

from broker.store import codec
from broker.store.codec import FrameError
from broker.store.commitlog import CommitLog
from broker.store.keyindex import KeyIndex
from broker.store.prepare import prepare
from broker.store.queues import QueueTable
from broker.store.recent import RecentRecords
from broker.store.record import Record, RecordColumns
from broker.store.writer import BatchWriter

FRAME = codec.encode(b"orders", 3, 41, 1.5, 2, b"id-1", b"key", b"tag",
                     codec.encode_headers({"h": "v"}), b"body")


def test_a_frame_round_trips() -> None:
    fields = codec.check(FRAME, 0, 1 << 20)
    assert fields is not None and codec.PREFIX.size + fields[0] == len(FRAME)
    message = codec.decode(FRAME, 0, fields, log_offset=99)
    assert (message.topic, message.queue, message.queue_offset, message.log_offset) == (
        "orders", 3, 41, 99)
    assert (message.message_id, message.key, message.tag, message.headers, message.body) == (
        "id-1", "key", "tag", {"h": "v"}, b"body")
    assert (message.store_time, message.attempt) == (1.5, 2)


def test_the_batch_writer_lays_frames_out_as_the_codec_does(tmp_path) -> None:
    log = CommitLog(tmp_path / "log", 1 << 20, fsync_on_roll=False)
    writer = BatchWriter(log, QueueTable(tmp_path / "cq", 16), KeyIndex(tmp_path / "ix", 8, 64),
                         b"abcd", RecentRecords(0))
    record = Record("orders", 3, b"body", key="key", tag="tag", headers={"h": "v"},
                    message_id="id-1", attempt=2)
    [placed] = writer.write(prepare(RecordColumns.of([record]), 1 << 20), 1.5).results()
    written = log.active.read(0, 1 << 20)
    assert written == codec.encode(b"orders", 3, 0, 1.5, 2, b"id-1", b"key", b"tag",
                                   codec.encode_headers({"h": "v"}), b"body")
    assert placed.size == len(written)
    log.close()


def test_a_batch_of_plain_records_is_laid_out_as_the_codec_does(tmp_path) -> None:
    """The writer's short way for a producer's batch (no key, tag or headers, one size): frame by
    frame what `codec.encode` makes, queue offsets counted per queue."""
    log = CommitLog(tmp_path / "log", 1 << 20, fsync_on_roll=False)
    writer = BatchWriter(log, QueueTable(tmp_path / "cq", 16), KeyIndex(tmp_path / "ix", 8, 64),
                         b"abcd", RecentRecords(0))
    records = [Record("orders", n % 3, b"body-%02d" % n, message_id=f"id-{n:02d}", attempt=4)
               for n in range(7)]
    placed = writer.write(prepare(RecordColumns.of(records), 1 << 20), 2.5).results()
    expected = b"".join(codec.encode(b"orders", n % 3, n // 3, 2.5, 4, b"id-%02d" % n, b"", b"", b"",
                                     b"body-%02d" % n) for n in range(7))
    assert log.active.read(0, 1 << 20) == expected
    assert [p.queue_offset for p in placed] == [n // 3 for n in range(7)]
    log.close()


def test_a_partial_frame_asks_for_more_bytes() -> None:
    for cut in (0, 1, 2, codec.FRAME_MIN, len(FRAME) - 1):
        assert codec.check(FRAME[:cut], 0, 1 << 20) is None


@pytest.mark.parametrize("position", range(0, len(FRAME), 3))
def test_any_flipped_bit_is_detected(position: int) -> None:
    damaged = bytearray(FRAME)
    damaged[position] ^= 0x10
    with pytest.raises(FrameError):
        if codec.check(bytes(damaged), 0, 1 << 20) is None:
            raise FrameError("length now points past the data")


def test_zeros_and_oversized_lengths_are_not_frames() -> None:
    with pytest.raises(FrameError, match="magic"):
        codec.check(bytes(64), 0, 1 << 20)
    with pytest.raises(FrameError, match="length"):
        codec.check(FRAME, 0, 32)
