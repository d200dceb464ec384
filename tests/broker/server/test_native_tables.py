"""Lists of messages as tables: what goes in comes out, a malformed table is refused by name;
pipelined publishes that run together answer each request as if it had run alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from broker.async_client import AsyncClient
from broker.client import Client
from broker.delivery.engine import Broker
from broker.delivery.values import (
    DELIVERY_FIELDS,
    PLACEMENT_FIELDS,
    Delivery,
    MessageColumns,
    OutgoingMessage,
    Placement,
    PlacementColumns,
)
from broker.errors import InvalidNameError
from broker.protocol.errors import MalformedFrameError
from broker.protocol.tables import (
    checked_messages,
    outgoing_table,
    rows,
    table,
)
from broker.server.auth import OPEN
from broker.server.engine import Engine
from broker.server.metrics import ServerMetrics
from broker.server.native_ops import Context
from broker.server.native_runs import TOGETHER
from tests.broker.server.serving import ServerProcess

texts = st.text(max_size=6)
messages = st.builds(
    OutgoingMessage, body=st.binary(max_size=8), key=texts, tag=texts,
    headers=st.dictionaries(texts, texts, max_size=2), message_id=texts,
    queue=st.none() | st.integers(0, 7), deliver_at=st.sampled_from([0.0, 1.5, 2e9]))
deliveries = st.builds(
    Delivery, receipt=texts, topic=st.sampled_from(["a", "b"]), queue=st.integers(0, 3),
    offset=st.integers(0, 2**40), message_id=texts, body=st.binary(max_size=8), key=texts,
    tag=st.sampled_from(["", "t"]), headers=st.dictionaries(texts, texts, max_size=2),
    delivery_count=st.integers(1, 3), published_at=st.floats(0, 2e9))


def wire(value: object) -> object:
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)


@settings(max_examples=100)
@given(st.lists(deliveries, max_size=6))
def test_deliveries_come_out_as_they_went_in(sent) -> None:
    assert rows(Delivery, wire(table(sent, DELIVERY_FIELDS)), "messages") == sent


@settings(max_examples=100)
@given(st.lists(messages, max_size=6))
def test_published_messages_come_out_as_they_went_in(sent) -> None:
    carried = wire(outgoing_table(sent, [m.message_id for m in sent]))
    assert checked_messages(carried, "publish: messages") == sent


def test_placements_and_fields_left_out_take_their_defaults() -> None:
    placed = [Placement("t", 0, n, f"m{n}", duplicate=n == 1) for n in range(3)]
    assert rows(Placement, wire(table(placed, PLACEMENT_FIELDS)), "placements") == placed
    carried = {"count": 2, "same": {}, "columns": {"body": [b"a", b"b"]}}
    assert checked_messages(carried, "publish") == [OutgoingMessage(b"a"), OutgoingMessage(b"b")]


@pytest.mark.parametrize(("carried", "culprit"), [
    ([{"body": b"x"}], "count, same and columns"),
    ({"count": 2, "same": {}, "columns": {"body": [b"x"]}}, "list of 2"),
    ({"count": 1, "same": {"body": b"x"}, "columns": {"body": [b"y"]}}, "in same and columns"),
    ({"count": 1, "same": {}, "columns": {"key": ["k"]}}, "'body' is required"),
    ({"count": 1, "same": {"body": "text"}, "columns": {}}, "'body' must be bytes"),
    ({"count": 1, "same": {"body": b"x", "queue": True}, "columns": {}}, "'queue' must be int or nil"),
    ({"count": 1, "same": {"body": b"x", "headers": {"a": 1}}, "columns": {}}, "'headers'"),
    ({"count": 1, "same": {"body": b"x", "receipt": "r"}, "columns": {}}, "'receipt' must be absent"),
])
def test_a_malformed_table_is_refused_naming_the_field(carried, culprit) -> None:
    with pytest.raises(MalformedFrameError, match=culprit):
        checked_messages(carried, "publish: messages")


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProcess]:
    started = ServerProcess(tmp_path / "data").start()
    yield started
    started.stop()


def test_pipelined_publishes_keep_their_order_ids_and_errors(server, unique) -> None:
    async def scenario() -> tuple[list[object], list[Delivery]]:
        async with AsyncClient(server.url) as client:
            sent = [[OutgoingMessage(f"{n}-{i}".encode(), key="k", message_id=f"{n}-{i % 3}")
                     for i in range(5)] for n in range(20)]
            bad = [OutgoingMessage(b"x", queue=999)]  # no such queue: this request alone fails
            replies = await asyncio.gather(*(client.publish(unique, batch) for batch in sent[:10]),
                                           client.publish(unique, bad),
                                           *(client.publish(unique, batch) for batch in sent[10:]),
                                           return_exceptions=True)
            member = await client.join("g", [unique])
            got: list[Delivery] = []
            while fetched := await client.fetch(member, 500, 0.5):
                got += fetched
            return replies, got

    replies, got = asyncio.run(scenario())
    assert isinstance(replies[10], Exception) and "queue" in str(replies[10])
    placed = [p for reply in replies if isinstance(reply, list) for p in reply]
    assert [p.duplicate for p in placed] == [i >= 3 for n in range(20) for i in range(5)]
    assert [d.body for d in got] == [f"{n}-{i}".encode() for n in range(20) for i in range(3)]


def test_a_run_of_publishes_is_one_engine_call_and_a_bad_request_fails_alone(tmp_path) -> None:
    async def scenario() -> tuple[list[object], int]:
        broker = Broker(tmp_path / "broker")
        engine = Engine(broker)
        calls = 0
        publish = engine.publish_columns

        async def counted(topic: str, sent: MessageColumns,
                          batch_ids: Sequence[tuple[str, int]] = ()) -> PlacementColumns:
            nonlocal calls
            calls += 1
            return await publish(topic, sent, batch_ids)

        engine.publish_columns = counted  # type: ignore[method-assign]
        ctx = Context(engine, OPEN, ServerMetrics(CollectorRegistry()), 1.0)
        requests = [{"topic": "t", "messages": outgoing_table([OutgoingMessage(b"a", queue=q)], [f"m{q}"])}
                    for q in (0, 99, 1)]  # the second names a queue that does not exist
        replies = await TOGETHER["publish"].run(ctx, requests)
        malformed = {"topic": "t", "messages": "nope"}
        alone = await TOGETHER["publish"].run(ctx, [malformed, requests[1]])  # each its own error
        assert [type(error) for error in alone] == [MalformedFrameError, InvalidNameError]
        together = await TOGETHER["publish"].run(ctx, [{"topic": "t", "messages": r["messages"]}
                                                        for r in (requests[0], requests[2])])
        engine.close()
        broker.close()
        return [*replies, *together], calls

    replies, calls = asyncio.run(scenario())
    assert calls == 1 + 3 + 1 + 1  # together, each alone once refused; the one good alone; together
    assert isinstance(replies[1], InvalidNameError)
    placed = [rows(Placement, r["placements"], "placements") for r in replies if isinstance(r, dict)]
    assert placed == [[Placement("t", 0, 0, "m0")], [Placement("t", 1, 0, "m1")],  # resent: duplicates
                      [Placement("t", 0, 0, "m0", True)], [Placement("t", 1, 0, "m1", True)]]


def run_publishes(path, requests: list[dict], *, together: bool) -> list[object]:
    """The replies to ``requests`` run as one run (``together``) or one by one, on a new broker
    in ``path``; then what the broker holds (topics, and the bodies of ``t``)."""
    async def scenario() -> list[object]:
        engine = Engine(Broker(path))
        ctx = Context(engine, OPEN, ServerMetrics(CollectorRegistry()), 1.0)
        run = TOGETHER["publish"].run
        replies = (await run(ctx, requests) if together
                   else [reply for request in requests for reply in await run(ctx, [request])])
        broker = engine.api
        assert isinstance(broker, Broker)
        held = [t.name for t in broker.topics()]
        member = broker.join("g", ["t"]) if held else None
        bodies = sorted(d.body for d in broker.fetch(member, 100, 0)) if member else []
        engine.close()
        broker.close()
        return [*replies, held, bodies]

    return asyncio.run(scenario())


def test_a_malformed_publish_table_is_refused_and_nothing_is_stored(tmp_path) -> None:
    bad = [{"count": 1, "same": {"body": "text"}, "columns": {}},
           {"count": 2, "same": {}, "columns": {"body": [b"x", b"y"], "deliver_at": [1.0, "soon"]}},
           {"count": 1, "same": {"key": "k"}, "columns": {}},
           {"count": 1, "same": {"body": b"x", "headers": {"h": 1}}, "columns": {}}]
    *replies, held, bodies = run_publishes(tmp_path / "b", [{"topic": "t", "messages": m} for m in bad],
                                           together=True)
    assert all(isinstance(reply, MalformedFrameError) for reply in replies)
    assert held == [] and bodies == []


def test_a_run_of_publishes_places_and_stores_what_each_alone_does(tmp_path) -> None:
    at = 1e9  # due long ago: delivered at once
    requests = [
        {"topic": "t", "messages": wire(outgoing_table(
            [OutgoingMessage(b"a", key="k", tag="x", headers={"h": "v"}), OutgoingMessage(b"b", key="k")],
            ["a", "b"]))},
        {"topic": "t", "messages": {"count": 2, "same": {"queue": 3, "deliver_at": int(at)},
                                    "columns": {"body": [b"c", b"d"], "message_id": ["c", "a"]}}},
        {"topic": "t", "messages": {"count": 1, "same": {"body": "not bytes"}, "columns": {}}},
        {"topic": "t", "messages": wire(outgoing_table([OutgoingMessage(b"e", deliver_at=at)], ["b"]))},
    ]
    together = run_publishes(tmp_path / "together", requests, together=True)
    alone = run_publishes(tmp_path / "alone", requests, together=False)
    assert isinstance(together[2], MalformedFrameError) and isinstance(alone[2], MalformedFrameError)
    placed = [rows(Placement, reply["placements"], "placements") for reply in together[:4]
              if isinstance(reply, dict)]
    assert placed == [rows(Placement, reply["placements"], "placements") for reply in alone[:4]
                      if isinstance(reply, dict)]
    assert [[p.duplicate for p in reply] for reply in placed] == [[False, False], [False, True], [True]]
    assert placed[1][0].queue == 3 and placed[1][1] == replace(placed[0][0], duplicate=True)
    assert together[4:] == alone[4:] == [["t"], [b"a", b"b", b"c"]]


def test_a_run_of_publishes_named_by_batch_ids_places_and_stores_what_each_alone_does(tmp_path) -> None:
    def named(batch_id: str, *bodies: bytes) -> dict:
        return {"topic": "t", "batch": batch_id,
                "messages": wire(outgoing_table([OutgoingMessage(b) for b in bodies], None))}

    requests = [
        named("p1", b"a", b"b"),
        named("p2", b"c"),
        {**named("p3", b"x"), "messages": wire(outgoing_table([OutgoingMessage(b"x")], ["m"]))},
        named("x" * 65, b"y"),
        named("p1", b"a", b"b"),  # a resend: dropped whole
        {"topic": "t", "messages": wire(outgoing_table([OutgoingMessage(b"d")], ["d"]))},  # ids: alone
    ]
    together = run_publishes(tmp_path / "together", requests, together=True)
    alone = run_publishes(tmp_path / "alone", requests, together=False)
    for replies in (together, alone):
        assert [type(reply) for reply in replies[2:4]] == [MalformedFrameError] * 2
        assert "names the messages itself" in str(replies[2])
    placed = [rows(Placement, reply["placements"], "placements") for reply in together[:6]
              if isinstance(reply, dict)]
    assert placed == [rows(Placement, reply["placements"], "placements") for reply in alone[:6]
                      if isinstance(reply, dict)]
    assert [[p.message_id for p in reply] for reply in placed] == [
        ["p1.0", "p1.1"], ["p2.0"], ["p1.0", "p1.1"], ["d"]]
    assert placed[2] == [replace(p, duplicate=True) for p in placed[0]]
    assert together[6:] == alone[6:] == [["t"], [b"a", b"b", b"c", b"d"]]


def test_the_clients_name_a_publish_without_ids_by_one_batch_id(tmp_path) -> None:
    server = ServerProcess(tmp_path / "data").start()
    try:
        client = Client(server.url)
        plain = client.publish("t", [OutgoingMessage(b"a"), OutgoingMessage(b"b")])
        batch_ids = {p.message_id.rpartition(".")[0] for p in plain}
        assert [p.message_id.rpartition(".")[2] for p in plain] == ["0", "1"] and len(batch_ids) == 1
        mixed = client.publish("t", [OutgoingMessage(b"c", message_id="mine"), OutgoingMessage(b"d")])
        assert mixed[0].message_id == "mine" and len(mixed[1].message_id) == 32  # one made here

        async def asynchronous() -> list[Placement]:
            async with AsyncClient(server.url) as pipelined:
                return await pipelined.publish("t", [OutgoingMessage(b"e")])

        [placed] = asyncio.run(asynchronous())
        assert placed.message_id.endswith(".0") and placed.message_id[:-2] not in batch_ids
        member = client.join("g", ["t"])
        got = {d.body: d.message_id for d in client.fetch(member, 10, 1.0)}
        assert got == {b"a": plain[0].message_id, b"b": plain[1].message_id, b"c": "mine",
                       b"d": mixed[1].message_id, b"e": placed.message_id}
        client.close()
    finally:
        server.stop()
