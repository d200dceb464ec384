"""The console's history of topic sizes while the wall clock steps: the publish rate is measured
on the monotonic clock, over the real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.console.history import History
from broker.console.sources import EngineView
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.store import FakeClock, StoreConfig


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["forward", "back"])
def test_a_topics_publish_rate_is_its_messages_per_second_whichever_way_the_wall_clock_steps(
    tmp_path: Path, step: float
) -> None:
    clock = FakeClock()
    with Broker(tmp_path / "broker", store_config=StoreConfig(clock=clock), clock=clock) as broker:
        history = History(EngineView(broker), interval=10, keep=3600, clock=clock)
        broker.publish("orders", [OutgoingMessage(b"first", message_id="first")])
        history.sample()
        clock.step(step)
        clock.advance(10)
        broker.publish("orders", [OutgoingMessage(f"{n}".encode(), message_id=f"m{n}") for n in range(20)])
        history.sample()
        assert history.rate_of("orders") == pytest.approx(2.0)  # 20 messages in 10 s
        assert len(history.topics["orders"].samples) == 2  # a step forward drops none
