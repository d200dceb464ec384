"""The native frame codec: chunking never changes what is decoded, garbage gives clean errors."""

from __future__ import annotations

import itertools
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.protocol import codec as native_codec
from broker.protocol.codec import FrameDecoder, decode_body, encode
from broker.protocol.errors import (
    BrokenStreamError,
    FrameTooLargeError,
    MalformedFrameError,
    ProtocolError,
    UnsupportedVersionError,
)

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
bodies = st.dictionaries(st.text(max_size=8), values, max_size=5)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=200)
@given(st.lists(bodies, min_size=1, max_size=6), st.lists(st.integers(0, 10_000), max_size=20))
def test_any_split_of_valid_frames_decodes_to_the_same_bodies(frames, cuts) -> None:
    stream = b"".join(encode(body) for body in frames)
    decoder = FrameDecoder()
    payloads = [p for chunk in chunked(stream, cuts) for p in decoder.feed(chunk)]
    assert [decode_body(p) for p in payloads] == frames
    assert decoder.buffered == 0


@settings(max_examples=300)
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=10))
def test_garbage_gives_protocol_errors_and_nothing_else(garbage, cuts) -> None:
    decoder = FrameDecoder(max_frame_size=256)
    try:
        for chunk in chunked(garbage, cuts):
            for payload in decoder.feed(chunk):
                try:
                    decode_body(payload)
                except MalformedFrameError:
                    pass
    except ProtocolError as error:
        assert error.fatal
        with pytest.raises(type(error)):
            decoder.feed(b"")  # a broken stream stays broken


def test_an_oversized_frame_is_refused_from_its_length_prefix_alone() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    with pytest.raises(FrameTooLargeError, match="1025 bytes exceeds max_frame_size 1024"):
        decoder.feed(struct.pack(">I", 1025))  # four bytes: no version byte, no body yet
    assert decoder.buffered == 0


def test_a_frame_exactly_at_the_limit_is_accepted() -> None:
    frame = encode({"op": "ping", "id": 1})
    decoder = FrameDecoder(max_frame_size=len(frame) - 4)
    assert decode_body(decoder.feed(frame)[0]) == {"op": "ping", "id": 1}


def test_an_unknown_version_byte_is_refused() -> None:
    with pytest.raises(UnsupportedVersionError, match="version 9"):
        FrameDecoder().feed(encode({"op": "ping"}, version=9))


def test_a_zero_length_is_a_broken_stream() -> None:
    with pytest.raises(BrokenStreamError):
        FrameDecoder().feed(b"\x00\x00\x00\x00\x01")


@pytest.mark.parametrize("payload, reason", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb([1, 2]), "must be a map, got list"),
    (msgpack.packb({"a": 1}) + b"\x01", "not valid msgpack"),
    (msgpack.packb({1: 2}), "not valid msgpack"),
])
def test_a_body_that_is_not_a_map_is_malformed_but_not_fatal(payload, reason) -> None:
    frame = struct.pack(">IB", len(payload) + 1, native_codec.VERSION) + payload
    [body] = FrameDecoder().feed(frame)
    with pytest.raises(MalformedFrameError, match=reason) as caught:
        decode_body(body)
    assert not caught.value.fatal


def test_bytes_and_text_keep_their_types() -> None:
    [payload] = FrameDecoder().feed(encode({"body": b"\x00\xff", "key": "ключ"}))
    assert decode_body(payload) == {"body": b"\x00\xff", "key": "ключ"}


def test_a_feed_told_to_stop_leaves_what_follows_unchecked_until_the_next_feed() -> None:
    """The server stops at a hello, before authentication: the frame behind it is checked against
    the limit that holds once the hello passed."""
    decoder = FrameDecoder(max_frame_size=64)
    small, large = encode({"op": "hello"}), encode({"body": b"x" * 200})
    assert [decode_body(p) for p in decoder.feed(small + large, stop=lambda payload: True)] == [{"op": "hello"}]
    decoder.max_frame_size = 1024
    assert decode_body(decoder.feed(b"")[0]) == {"body": b"x" * 200}
