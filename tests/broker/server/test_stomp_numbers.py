"""Numbers on the STOMP wire, property-based: ASCII digits of bounded length, or an error naming the header.

``str.isdigit`` accepted ``²``, ``٣`` and a 4,301-digit string, on which ``int``
then raised inside the session (a traceback, no ERROR frame).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.protocol.errors import BrokenStreamError, MalformedFrameError
from broker.server.stomp_codec import StompDecoder, parse_number

ascii_numbers = st.text("0123456789", min_size=1, max_size=18)


@given(ascii_numbers)
def test_ascii_digits_up_to_18_are_read_as_their_value(raw: str) -> None:
    assert parse_number("content-length", raw, BrokenStreamError) == int(raw)


@given(st.text(max_size=30).filter(lambda raw: not (raw.isascii() and raw.isdecimal() and len(raw) <= 18)))
def test_anything_else_is_refused_naming_the_header(raw: str) -> None:
    with pytest.raises(MalformedFrameError, match="activemq.prefetchSize"):
        parse_number("activemq.prefetchSize", raw, MalformedFrameError)


@given(st.sampled_from(["\u00b2", "\u0663", "\uff15", "1" * 19, "9" * 4301, "-1", "+1", " 1", "1 ", "1_0", "0x1"]))
def test_the_decoder_refuses_a_content_length_that_is_no_byte_count(raw: str) -> None:
    with pytest.raises(BrokenStreamError, match="content-length"):
        StompDecoder(1 << 20).feed(f"SEND\ndestination:/queue/q\ncontent-length:{raw}\n\nx\0".encode())
