"""The STOMP codec: any chunking decodes the same frames; escaping and size rules per version."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.protocol import codec as native_codec
from broker.protocol.errors import BrokenStreamError, FrameTooLargeError, ProtocolError
from broker.server.stomp_codec import StompDecoder, StompFrame, encode

#: no NUL: no version can carry it, so `encode` leaves such a header out (tested below)
header_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)
commands = st.sampled_from(["SEND", "MESSAGE", "SUBSCRIBE", "ACK", "NACK", "RECEIPT", "ERROR"])


@st.composite
def frames(draw, version: str) -> StompFrame:
    names = header_text.filter(lambda n: n != "content-length" and n)
    values = header_text
    if version == "1.1":  # 1.1 cannot escape CR; a raw CR is kept as is
        names = names.filter(lambda n: "\r" not in n)
    headers = draw(st.dictionaries(names, values, max_size=4))
    return StompFrame(draw(commands), headers, draw(st.binary(max_size=64)))


def without_length(frame: StompFrame) -> StompFrame:
    headers = {k: v for k, v in frame.headers.items() if k != "content-length"}
    return StompFrame(frame.command, headers, frame.body)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_any_split_of_frames_and_heartbeats_decodes_the_same(version) -> None:
    @settings(max_examples=150)
    @given(st.lists(frames(version), min_size=1, max_size=5),
           st.lists(st.sampled_from([b"", b"\n", b"\n\n"] + ([b"\r\n"] if version == "1.2" else [])),
                    min_size=5, max_size=5),
           st.lists(st.integers(0, 5000), max_size=20))
    def check(sent, beats, cuts) -> None:
        stream = b"".join(beat + encode(frame, version) for frame, beat in zip(sent, beats))
        decoder = StompDecoder(1 << 20, version)
        got = [f for chunk in chunked(stream, cuts) for f in decoder.feed(chunk)]
        assert [without_length(f) for f in got] == sent

    check()


@settings(max_examples=300)
@given(st.binary(max_size=200), st.lists(st.integers(0, 300), max_size=8),
       st.sampled_from(["1.0", "1.1", "1.2"]))
def test_garbage_gives_protocol_errors_and_nothing_else(garbage, cuts, version) -> None:
    decoder = StompDecoder(128, version)
    try:
        for chunk in chunked(garbage, cuts):
            decoder.feed(chunk)
    except ProtocolError:
        pass


def test_escapes_differ_between_1_1_and_1_2() -> None:
    frame = StompFrame("SEND", {"a:b": "line\nnext\\x"})
    assert b"a\\cb:line\\nnext\\\\x\n" in encode(frame, "1.1")
    assert StompDecoder(1024, "1.2").feed(b"SEND\nk:cr\\r\n\n\0") == [StompFrame("SEND", {"k": "cr\r"})]
    with pytest.raises(BrokenStreamError, match="undefined escape"):
        StompDecoder(1024, "1.1").feed(b"SEND\nk:cr\\r\n\n\0")
    with pytest.raises(BrokenStreamError, match="undefined escape"):
        StompDecoder(1024, "1.2").feed(b"SEND\nk:tab\\t\n\n\0")


def test_1_0_does_not_unescape_and_1_2_accepts_crlf() -> None:
    assert StompDecoder(1024, "1.0").feed(b"SEND\nk:a\\nb\n\n\0")[0].headers == {"k": "a\\nb"}
    assert StompDecoder(1024, "1.2").feed(b"SEND\r\nk:v\r\n\r\nhi\0") == [
        StompFrame("SEND", {"k": "v"}, b"hi")]
    assert StompDecoder(1024, "1.1").feed(b"SEND\nk:v\r\n\nhi\0")[0].headers == {"k": "v\r"}


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2"])
def test_a_header_the_version_cannot_carry_is_left_out(version) -> None:
    headers = {"nul": "a\0b", "nul\0name": "v", "lf": "one\ntwo", "a:b": "colon", "kept": "v"}
    [frame] = StompDecoder(1024, version).feed(encode(StompFrame("MESSAGE", headers, b"x"), version))
    escapes = version != "1.0"  # 1.0 has none: a line feed or a ':' in a name cannot be written
    assert frame.headers == {"kept": "v", "content-length": "1",
                             **({"lf": "one\ntwo", "a:b": "colon"} if escapes else {})}


def test_connect_headers_are_never_unescaped() -> None:
    [frame] = StompDecoder(1024).feed(b"CONNECT\nlogin:a\\c\npasscode:x:y\n\n\0")
    assert frame.headers == {"login": "a\\c", "passcode": "x:y"}


def test_the_first_repeated_header_wins() -> None:
    [frame] = StompDecoder(1024).feed(b"SEND\nk:first\nk:second\n\n\0")
    assert frame.headers == {"k": "first"}


def test_content_length_carries_nul_bytes() -> None:
    body = b"\0a\0\xff"
    [frame] = StompDecoder(1024).feed(encode(StompFrame("SEND", {"destination": "/queue/q"}, body)))
    assert frame.body == body and frame.headers["content-length"] == "4"


def test_an_oversized_frame_is_refused_from_content_length_before_its_body() -> None:
    decoder = StompDecoder(1000)
    with pytest.raises(FrameTooLargeError, match="exceeds max_frame_size 1000"):
        decoder.feed(b"SEND\ndestination:/queue/q\ncontent-length:5000\n\n")


def test_an_oversized_frame_without_content_length_is_refused_once_it_passes_the_limit() -> None:
    decoder = StompDecoder(100)
    assert decoder.feed(b"SEND\n\n" + b"x" * 90) == []
    with pytest.raises(FrameTooLargeError):
        decoder.feed(b"x" * 10)


@pytest.mark.parametrize("raw, reason", [
    (b"SEND\nno-colon\n\n\0", "has no ':'"),
    (b"SE ND\n\n\0", "invalid STOMP command"),
    (b"SEND\ncontent-length:abc\n\n\0", "not a byte count"),
    (b"SEND\ncontent-length:1\n\nxy\0", "no NUL after"),
    (b"SEND\nk:\xff\n\n\0", "not UTF-8"),
])
def test_broken_frames_name_what_is_wrong(raw, reason) -> None:
    with pytest.raises(BrokenStreamError, match=reason):
        StompDecoder(1024).feed(raw)


def test_a_stream_no_command_can_begin_is_refused_at_its_first_byte() -> None:
    """A native-protocol hello (its length prefix begins with a zero byte) has no end of headers
    for the decoder to wait for: it is refused at once, not at the handshake timeout."""
    with pytest.raises(BrokenStreamError, match=r"not a STOMP frame: it begins with b'\\x00"):
        StompDecoder(1024).feed(native_codec.encode({"id": 1, "op": "hello"})[:1])
