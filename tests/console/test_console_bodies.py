"""Large and binary bodies on the console's pages: the first `SHOWN` bytes, and saying so.

A 100 MiB body made a hex dump of about 500 MB in memory and a page as large,
and the listing's one-line preview decoded each row's body whole.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterator

import pytest

from backends.types import DeadLetter, Failure, Message
from broker.console import render
from broker.delivery.values import OutgoingMessage as BrokerMessage
from tests.console.deployment import PASSWORDS, Deployment, start
from tests.console.http import Visitor
from tests.waiting import wait_until

BIG = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start(tmp_path_factory.mktemp("console"))
    yield deployment
    deployment.console.stop()
    deployment.app.close()


def alice(deployment: Deployment) -> Visitor:
    visitor = Visitor(deployment.url)
    assert visitor.log_in("alice", PASSWORDS["alice"]) == 303
    return visitor


def test_a_large_binary_dead_letter_shows_its_first_bytes_and_says_so(deployment: Deployment) -> None:
    message = Message(id="m-big", topic="payments", queue=0, offset=0, payload=os.urandom(BIG), key="k")
    with deployment.app.store.transaction() as tx:
        letter_id = tx.add_dead_letter(DeadLetter("billing", message, None, Failure("E", "e", "t", 1, 1.0, 2.0)))
    status, page = alice(deployment).get(f"/letters/{letter_id}")
    assert status == 200
    assert len(page) < 1024 * 1024  # a hex dump of the whole body was over 40 MB
    assert "The first 64.0 KiB (65,536 B) of 8.0 MiB (8,388,608 B) shown." in page
    status, page = alice(deployment).get("/groups/billing/letters")
    assert status == 200 and "m-big" not in page and len(page) < 64 * 1024


def test_a_large_message_found_by_key_shows_its_first_bytes(deployment: Deployment) -> None:
    deployment.app.publish("receipts", {"receipt": "r-1", "lines": "é" * (1024 * 1024)}, key="r-1")  # 2 MiB
    ops = Visitor(deployment.url)
    assert ops.log_in("ops", PASSWORDS["ops"]) == 303
    status, page = ops.get("/lookup?topic=receipts&key=r-1")
    assert status == 200, page[:500]
    assert len(page) < 1024 * 1024 and "The first 64.0 KiB" in page
    assert "00000000  " not in page  # cut on a character boundary: text, not a hex dump


def test_a_preview_reads_only_the_head_of_a_body() -> None:
    body = os.urandom(BIG)
    tracemalloc.start()
    try:
        line = render.preview(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024  # decoding and dumping the whole body took over 40 MB
    assert line.endswith("…") and len(line) == render.PREVIEW


def test_a_small_body_is_shown_whole() -> None:
    assert render.show(b'{"a": 1}') == render.Body("json", '{\n  "a": 1\n}', 8, 8)
    assert not render.show(b"\xff\x00").cut and render.show(b"\xff\x00").kind == "hex"
    cut = render.show("é".encode() * 10, limit=5)  # the head ends inside the third é
    assert (cut.kind, cut.text, cut.shown, cut.cut) == ("text", "éé", 4, True)


def test_a_listing_of_large_letters_reads_a_line_of_each_from_the_store(deployment: Deployment) -> None:
    """The listing read every body of its page whole from the store to show one line of each: 20
    letters of 8 MiB raised the console's memory by 167 MB, 100 MiB ones would take 5 GB a view."""
    body = ("ä" * (BIG // 2)).encode()  # 8 MiB of text
    with deployment.app.store.transaction() as tx:
        for n in range(6):
            message = Message(id=f"m-large-{n}", topic="payments", queue=0, offset=n, payload=body, key="k")
            tx.add_dead_letter(DeadLetter("billing", message, None, Failure("E", "e", "t", 1, 1.0, 2.0)))
    visitor = alice(deployment)  # the console serves from a thread of this process: its memory is traced
    tracemalloc.start()
    try:
        status, page = visitor.get("/groups/billing/letters")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 200 and page.count("ääää") >= 6 and page.count("…") >= 6  # a line of each, cut
    assert peak < BIG  # six whole bodies were 48 MiB


def test_a_listing_of_large_broker_letters_holds_what_it_shows_of_each(deployment: Deployment, unique) -> None:
    """The listing of ``%DLQ%<group>`` read each letter whole (up to ``max_record_size``, 4 MiB) to
    show its first 64 KiB: a page of 50 held 200 MiB and more. Each is cut as it is read now."""
    api, group, body = deployment.app.transport.api, f"ledger-{unique}", b"\xff" * (4 * 1024 * 1024 - 4096)
    api.publish(group, [BrokerMessage(body, key=f"k{n}") for n in range(8)])
    member = api.join(group, [group])
    for _ in range(8):  # a fetch hands out max_fetch_bytes at most: one letter each time
        (taken,) = wait_until(lambda: api.fetch(member, 1, 0.2), "the next message")
        api.dead_letter(member, [taken.receipt], "too large to post")
    api.leave(member)
    for _ in range(17):  # 68 MiB more: the letters are out of the store's recent_bytes (64 MiB), read from the log
        api.publish(f"filler-{unique}", [BrokerMessage(body)])
    ops = Visitor(deployment.url)
    assert ops.log_in("ops", PASSWORDS["ops"]) == 303
    tracemalloc.start()
    try:
        status, page = ops.get(f"/groups/{group}/letters?source=broker")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 200 and page.count("The first 64.0 KiB (65,536 B) of 4.0 MiB (4,190,208 B) shown.") == 8
    assert "x-dlq-body-size" not in page
    assert peak < 4 * len(body), peak  # one record read at a time; all eight were read whole: 45 MB
