"""Column-wise decoding of a run of frames: the same messages as the codec, or refused whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.store import MessageStore, Record, StoreConfig, codec
from broker.store.columns import decode_run


def run_of(frames: list[bytes], gap: bytes = b"") -> tuple[bytes, list[int], list[int]]:
    """The frames laid out with ``gap`` (another queue's bytes) between them."""
    data, starts = b"", []
    for frame in frames:
        starts.append(len(data))
        data += frame + gap
    return data, starts, [len(f) for f in frames]


FRAMES = [
    codec.encode(b"orders", 2, 7, 1.5, 0, b"id-7", b"", b"", b"", b"plain"),
    codec.encode(b"orders", 2, 8, 1.75, 3, b"id-8", "k\u00e9y".encode(), b"tag",
                 codec.encode_headers({"h": "v"}), b"\x00binary\xff"),
    codec.encode(b"orders", 2, 9, 2.0, 0, b"id-9", b"", b"tag", b"", b""),
]
PLAIN = [  # the store's common case: no key, tag or headers, ids of one length (the store's own)
    codec.encode(b"orders", 2, 7 + n, 1.5, 0, b"%024x" % n, b"", b"", b"", body)
    for n, body in enumerate([b"a" * 40, b"\xff" * 3, b""])
]
MIXED = [  # ids of several lengths; the last one's frame ends before an id as long as the first
    codec.encode(b"orders", 2, 7 + n, 1.5, 0, message_id, b"", b"", b"", body)
    for n, (message_id, body) in enumerate([(b"message-7", b"body"), (b"id-8", b"\x00" * 9), (b"9", b"")])
]

UNIFORM = [  # one size and one shape: a producer's batch, decoded by `decode_run`'s fast path
    codec.encode(b"orders", 2, 7 + n, 1.5 + n, n, b"%024x" % n, b"", b"", b"", bytes([n]) * 64)
    for n in range(4)
]
SAME_SIZE = [  # one size, several shapes: decoded the general way
    codec.encode(b"orders", 2, 7, 1.5, 0, b"%024x" % 7, b"", b"", b"", b"b" * 40),
    codec.encode(b"orders", 2, 8, 1.5, 0, b"%020x" % 8, b"", b"", b"", b"b" * 44),
    codec.encode(b"orders", 2, 9, 1.5, 0, b"%024x" % 9, b"key", b"t", b"", b"b" * 36),
]
assert len({len(frame) for frame in UNIFORM}) == len({len(frame) for frame in SAME_SIZE}) == 1


@pytest.mark.parametrize("frames", [FRAMES, FRAMES[:1], FRAMES[1:], PLAIN, MIXED, MIXED[1:], UNIFORM,
                                    SAME_SIZE])
def test_a_run_decodes_as_the_codec_decodes_each_frame(frames: list[bytes]) -> None:
    data, starts, sizes = run_of(frames, gap=b"\xb7\xe5 another queue's record")
    first = codec.check(frames[0], 0, 1 << 20)[3]  # type: ignore[index]
    run = decode_run(data, starts, sizes, first, b"orders", 2)
    assert run is not None
    for number, frame in enumerate(frames):
        message = codec.decode(frame, 0, codec.check(frame, 0, 1 << 20), 0)  # type: ignore[arg-type]
        assert (run.message_ids[number], run.keys[number], run.tags[number],
                dict(run.headers[number]), run.bodies[number], run.store_times[number],
                run.attempts[number]) == (message.message_id, message.key, message.tag,
                                          dict(message.headers), message.body, message.store_time,
                                          message.attempt)
    assert decode_run(*run_of(frames), first, b"orders", 2) == run  # the data ends with the last frame


@pytest.mark.parametrize("frames", [FRAMES, PLAIN, MIXED, UNIFORM, SAME_SIZE])
def test_a_run_with_any_damaged_or_misplaced_record_is_refused_whole(frames: list[bytes]) -> None:
    data, starts, sizes = run_of(frames)
    assert decode_run(data, starts, sizes, 7, b"orders", 2) is not None
    assert decode_run(data, starts, sizes, 8, b"orders", 2) is None  # queue offsets differ
    assert decode_run(data, starts, sizes, 7, b"orders", 3) is None  # another queue
    assert decode_run(data, starts, sizes, 7, b"events", 2) is None  # another topic
    assert decode_run(data, starts, [sizes[0], sizes[1] + 1, sizes[2]], 7, b"orders", 2) is None
    assert decode_run(data[:-1], starts, sizes, 7, b"orders", 2) is None  # cut short
    for position in range(len(data)):
        for bit in (0, 5):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            assert decode_run(bytes(damaged), starts, sizes, 7, b"orders", 2) is None, position


def test_read_batch_gives_the_columns_of_read(tmp_path: Path) -> None:
    with MessageStore(tmp_path, StoreConfig(read_chunk=4096)) as store:
        store.append([Record("orders", n % 3, f"body-{n}".encode() * (n % 50), key=f"k{n % 4}" if n % 2 else "",
                             tag="t" if n % 5 == 0 else "", headers={"n": str(n)} if n % 7 == 0 else {})
                      for n in range(600)])
        for queue in range(3):
            for start, count in ((0, 500), (17, 33), (150, 1)):
                batch = store.read_batch("orders", queue, start, count)
                assert batch.messages() == store.read("orders", queue, start, count)
                assert list(batch.queue_offsets) == list(range(start, min(start + count, 200)))


def test_records_with_the_same_headers_share_one_decoded_mapping() -> None:
    """Headers are decoded once per distinct encoding (a batch published together carries the
    same headers): the rows share the mapping, other headers and none stay their own."""
    same = codec.encode_headers({"content-type": "application/json"})
    frames = [codec.encode(b"orders", 2, 7 + n, 1.5, 0, b"%024x" % n, b"", b"", headers, b"{}")
              for n, headers in enumerate([same, same, codec.encode_headers({"h": "v"}), b"", same])]
    columns = decode_run(*run_of(frames), 7, b"orders", 2)
    assert columns is not None
    headers = columns.headers
    assert [dict(h) for h in headers] == [{"content-type": "application/json"}] * 2 + [{"h": "v"}, {}] + [
        {"content-type": "application/json"}]
    assert headers[0] is headers[1] is headers[4]
    assert headers[2] is not headers[0]
    assert list(columns.keys) == list(columns.tags) == [""] * 5  # headers alone: no key or tag to cut
