"""Latency-aware queue selection (RocketMQ's MQFaultStrategy) on a fake clock.

The store's append is wrapped so that an append touching a chosen queue moves
the fake clock forward (a slow append) or raises (a failed one): the latency
the engine measures is exactly what the test says, and nothing waits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from backends.errors import ConfigurationError
from backends.transport import open_transport
from backends.transport.embedded import EmbeddedTransport
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.selection import LatencyAware, LatencyTable, RoundRobin
from broker.delivery.values import OutgoingMessage
from broker.embedded import EmbeddedBroker
from broker.errors import BrokerConfigError
from broker.server.config import ServerConfig
from broker.server.run import settings_table
from broker.store import Appended, FakeClock, RecordColumns
from reliable.settings import Settings, SettingsError
from tests.broker.delivery.conftest import Open


class StoreTrouble:
    """Makes the broker's appends slow (clock moved by ``slow[queue]``) or failing (``failing``)
    whenever they write to one of the named queues."""

    def __init__(self, broker: Broker, clock: FakeClock) -> None:
        self.slow: dict[int, float] = {}
        self.failing: set[int] = set()
        self._append: Callable[[RecordColumns], Appended] = broker.store.append_columns
        self._clock = clock
        broker.store.append_columns = self.append  # type: ignore[method-assign]

    def append(self, records: RecordColumns) -> Appended:
        queues = set(records.queues)
        if queues & self.failing:
            raise OSError("injected: the disk is gone")
        self._clock.advance(max((self.slow.get(queue, 0.0) for queue in queues), default=0.0))
        return self._append(records)


def one_by_one(broker: Broker, count: int, topic: str = "orders", key: str = "") -> list[int]:
    """The queues of ``count`` messages published one per call."""
    return [broker.publish(topic, [OutgoingMessage(b"x", key=key)])[0].queue for _ in range(count)]


@pytest.fixture
def latency_broker(open_broker: Open) -> Broker:
    return open_broker(selection="latency_aware")


def test_round_robin_is_the_default_and_ignores_a_slow_queue(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker()
    trouble = StoreTrouble(broker, clock)
    trouble.slow[2] = 5.0
    assert one_by_one(broker, 8) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_slow_queue_is_avoided_for_its_duration_then_chosen_again(
    latency_broker: Broker, clock: FakeClock
) -> None:
    trouble = StoreTrouble(latency_broker, clock)
    trouble.slow[2] = 0.625  # >= 0.55 s: paused 30 s (RocketMQ's table)
    assert one_by_one(latency_broker, 3) == [0, 1, 2]
    paused_at = clock.time()
    trouble.slow.clear()
    during = one_by_one(latency_broker, 9)
    assert sorted(during) == [0, 0, 0, 1, 1, 1, 3, 3, 3]  # round robin over the others
    batch = latency_broker.publish("orders", [OutgoingMessage(b"x") for _ in range(6)])
    assert sorted(p.queue for p in batch) == [0, 0, 1, 1, 3, 3]
    clock.advance(29.5)
    assert clock.time() < paused_at + 30.0 and 2 not in one_by_one(latency_broker, 6)  # still paused
    clock.advance(0.5)
    assert sorted(one_by_one(latency_broker, 4)) == [0, 1, 2, 3]  # its 30 s are over: chosen again


def test_a_failed_append_counts_as_the_worst_latency(latency_broker: Broker, clock: FakeClock) -> None:
    trouble = StoreTrouble(latency_broker, clock)
    trouble.failing.add(1)
    assert one_by_one(latency_broker, 1) == [0]
    with pytest.raises(OSError, match="injected"):
        one_by_one(latency_broker, 1)  # its turn: queue 1, which fails
    trouble.failing.clear()
    assert 1 not in one_by_one(latency_broker, 12)
    clock.advance(599.0)  # the worst latency (15 s) pauses for 600 s
    assert 1 not in one_by_one(latency_broker, 6)
    clock.advance(1.0)
    assert 1 in one_by_one(latency_broker, 4)


def test_a_fast_append_to_a_paused_queue_ends_its_pause(latency_broker: Broker, clock: FakeClock) -> None:
    trouble = StoreTrouble(latency_broker, clock)
    trouble.slow[0] = 1.0
    assert one_by_one(latency_broker, 1) == [0]
    trouble.slow.clear()
    assert 0 not in one_by_one(latency_broker, 6)
    latency_broker.publish("orders", [OutgoingMessage(b"x", queue=0)])  # asked for: fast now
    assert sorted(one_by_one(latency_broker, 4)) == [0, 1, 2, 3]


def test_when_every_queue_is_paused_the_least_bad_one_takes_the_messages(
    latency_broker: Broker, clock: FakeClock
) -> None:
    trouble = StoreTrouble(latency_broker, clock)
    trouble.slow.update({0: 3.0, 1: 0.6, 2: 2.0, 3: 1.0})  # paused 180, 30, 120, 60 s
    assert sorted(one_by_one(latency_broker, 4)) == [0, 1, 2, 3]  # each paused by its own append
    trouble.slow.clear()
    assert one_by_one(latency_broker, 1) == [1]  # the least bad: its pause ends first
    # that fast append ended queue 1's pause: it is the only one available
    assert one_by_one(latency_broker, 3) == [1, 1, 1]


def test_keys_still_go_by_hash_to_a_paused_queue(latency_broker: Broker, clock: FakeClock) -> None:
    trouble = StoreTrouble(latency_broker, clock)
    keyed = one_by_one(latency_broker, 1, key="customer-7")[0]
    trouble.slow[keyed] = 1.0  # paused 60 s by its next append
    assert one_by_one(latency_broker, 3, key="customer-7") == [keyed] * 3  # order per key kept
    trouble.slow.clear()
    trouble.failing.add(keyed)
    with pytest.raises(OSError):
        one_by_one(latency_broker, 1, key="customer-7")  # the key's queue, failing or not
    trouble.failing.clear()
    assert keyed not in one_by_one(latency_broker, 6)  # keyless messages avoid it


def test_the_latency_table_follows_rocketmq() -> None:
    table = LatencyTable()
    assert [table.pause(s) for s in (0.0, 0.05, 0.1, 0.549, 0.55, 1.0, 2.0, 3.0, 14.9, 15.0, 99.0)] == [
        0, 0, 0, 0, 30, 60, 120, 180, 180, 600, 600]
    custom = LatencyAware(FakeClock(), LatencyTable(latency_max=(0.01,), not_available_duration=(5.0,)))
    custom.appended("t", [1], 0.02)
    assert list(custom.paused("t")) == [1]
    assert RoundRobin().spread("t", 3, 5) == [0, 1, 2, 0, 1]


@pytest.mark.parametrize(("settings", "named"), [
    ({"selection": "fastest"}, "selection='fastest': expected one of round_robin, latency_aware"),
    ({"latency_max": (0.1, 0.05)}, "latency_max"),
    ({"latency_max": ()}, "latency_max"),
    ({"not_available_duration": (0.0, 1.0)}, "not_available_duration"),
    ({"not_available_duration": (0.0,) * 6 + (-1.0,)}, "not_available_duration"),
])
def test_a_bad_selection_setting_is_named(settings: dict[str, object], named: str) -> None:
    with pytest.raises(BrokerConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        DeliveryConfig(**settings)  # type: ignore[arg-type]


def test_the_embedded_transport_takes_selection_from_its_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="selection='fastest'"):
        open_transport(f"embedded://{tmp_path}/broker?selection=fastest")
    transport = open_transport(f"embedded://{tmp_path}/broker?selection=latency_aware")
    try:
        assert isinstance(transport, EmbeddedTransport) and isinstance(transport.api, EmbeddedBroker)
        assert isinstance(transport.api.engine.publishing.selector, LatencyAware)
    finally:
        transport.close()


def test_the_settings_file_names_a_bad_selection_and_the_server_takes_a_good_one(tmp_path: Path) -> None:
    path = tmp_path / "reliable.toml"
    path.write_text('[broker]\nselection = "fastest"\n')
    with pytest.raises(SettingsError) as info:
        Settings.load(path, env={})
    assert str(info.value) == (f"{path}: broker.selection = 'fastest' is not allowed; "
                               "expected one of round_robin, latency_aware")
    path.write_text('[broker]\nselection = "latency_aware"\n')
    assert Settings.load(path, env={}).broker.selection == "latency_aware"
    ServerConfig.from_mapping(settings_table(str(path)))  # an engine key, not an unknown one
