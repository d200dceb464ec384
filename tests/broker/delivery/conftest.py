"""The delivery engine on a fake clock, in a fresh directory per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.store import FakeClock, StoreConfig

Open = Callable[..., Broker]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def open_broker(tmp_path: Path, clock: FakeClock) -> Iterator[Open]:
    opened: list[Broker] = []

    def open_(path: Path | None = None, **settings: object) -> Broker:
        store = StoreConfig(clock=clock, **{k[6:]: v for k, v in settings.items() if k.startswith("store_")})  # type: ignore[arg-type]
        config = DeliveryConfig(**{k: v for k, v in settings.items() if not k.startswith("store_")})  # type: ignore[arg-type]
        broker = Broker(path or tmp_path / "broker", config, store_config=store, clock=clock)
        opened.append(broker)
        return broker

    yield open_
    for broker in opened:
        broker.close()


@pytest.fixture
def broker(open_broker: Open) -> Broker:
    return open_broker()


def messages(count: int, prefix: str = "m", key: str = "", tag: str = "") -> list[OutgoingMessage]:
    return [OutgoingMessage(f"{prefix}{n}".encode(), key=key, tag=tag, message_id=f"{prefix}{n}")
            for n in range(count)]


def drain(broker: Broker, member: str, batch: int = 50) -> list:
    received = []
    while deliveries := broker.fetch(member, batch, 0):
        broker.ack(member, [d.receipt for d in deliveries])
        received += deliveries
    return received
