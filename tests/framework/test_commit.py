"""Commit strategies and the contiguous-offset watermark."""

from __future__ import annotations

from backends.types import Message, QueueRef
from reliable import App, Batch, OffsetWatermark
from reliable.commit import Async, commit_strategy

from .conftest import effects, pending, write_effect


def message(offset: int, queue: int = 0) -> Message:
    return Message(id=f"m{offset}", topic="t", queue=queue, offset=offset, payload=b"{}")


def test_watermark_commits_only_the_contiguous_prefix() -> None:
    mark = OffsetWatermark()
    mark.fetched([message(o) for o in range(5)] + [message(0, queue=1)])
    assert mark.mark_done([message(1), message(2)]) == {}  # 0 still in flight
    assert mark.mark_done([message(0)]) == {QueueRef("t", 0): 3}
    assert mark.mark_done([message(4)]) == {}
    assert mark.mark_done([message(3), message(0, queue=1)]) == {QueueRef("t", 0): 5, QueueRef("t", 1): 1}
    assert mark.committable() == {QueueRef("t", 0): 5, QueueRef("t", 1): 1}


def test_batch_strategy_acks_by_size_and_by_interval() -> None:
    acked: list[list[int]] = []
    strategy = Batch(size=3, interval=10.0)

    def ack(ms: list[Message]) -> None:
        acked.append([m.offset for m in ms])

    strategy.done([message(0), message(1)], ack, now=100.0)
    assert acked == []
    strategy.done([message(2)], ack, now=101.0)
    assert acked == [[0, 1, 2]]
    strategy.done([message(3)], ack, now=102.0)
    strategy.tick(ack, now=111.0)
    assert acked == [[0, 1, 2]]  # 9 s since the first pending one
    strategy.tick(ack, now=112.0)
    assert acked == [[0, 1, 2], [3]]


def test_async_strategy_acks_in_the_background_and_flushes() -> None:
    acked: list[int] = []
    strategy = Async()
    for o in range(50):
        strategy.done([message(o)], lambda ms: acked.extend(m.offset for m in ms), now=0.0)
    strategy.flush(lambda ms: None)
    assert acked == list(range(50))
    strategy.close()


def test_every_strategy_acks_everything_end_to_end(app: App) -> None:
    for name in ("per_message", "batch", "async", "transactional"):
        topic = f"orders-{name}"

        @app.handler(topic, name=f"h_{name}", token="body.id", commit=name)
        def handle(msg: Message, tx) -> None:
            write_effect(tx, msg.body["id"])

        app.publish_many(topic, [{"id": f"{name}-{i}"} for i in range(7)])
        app.run(until_idle=True, handlers=[f"h_{name}"])
        assert pending(app, f"h_{name}", topic) == 0, name
    assert len(effects(app)) == 28


def test_transactional_strategy_stores_offsets_with_the_token(app: App) -> None:
    @app.handler("orders", token="body.id", commit="transactional")
    def handle(msg: Message, tx) -> None:
        write_effect(tx, msg.body["id"])

    app.publish_many("orders", [{"id": f"o{i}"} for i in range(10)], key="same-key")
    app.run(until_idle=True)
    offsets = app.store.load_offsets("handle")
    assert sum(offsets.values()) == 10 and len(offsets) == 1  # one key: one queue, offsets 0..9 done


def test_strategy_names_are_checked() -> None:
    import pytest

    from reliable.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="'eventually' is not allowed"):
        commit_strategy("eventually")
