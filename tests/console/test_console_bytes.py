"""Bytes kept per topic: on the topics page and in the `topics` operation that feeds it, the same
after the broker restarts, and smaller once retention has deleted a segment."""

from __future__ import annotations

import re
from pathlib import Path

from broker.console.config import ConsoleConfig
from broker.console.serving import start_console
from broker.console.sources import EngineView
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.server.auth import Authenticator, load_users
from broker.store import FakeClock, StoreConfig
from broker.store.codec import FRAME_MIN
from tests.console.deployment import PASSWORDS, USERS
from tests.console.http import Visitor

ROW = re.compile(r"<tr><td>(?P<topic>[^<]+)</td>.*?<td class=\"bytes\">[^<]*?\(?(?P<bytes>[\d,]+) B\)?</td>")


def publish(broker: Broker, topic: str, body_size: int, count: int) -> int:
    """Publish ``count`` bodies of ``body_size`` bytes; the bytes their records take in the log."""
    bodies = [bytes([65 + i % 26]) * body_size for i in range(count)]
    placed = broker.publish(topic, [OutgoingMessage(body) for body in bodies])
    return sum(FRAME_MIN + len(topic) + len(p.message_id) + body_size for p in placed)


def on_page(broker: Broker, directory: Path) -> dict[str, int]:
    """The bytes column of the topics page, as the admin ``ops`` sees it through a console."""
    console = start_console(ConsoleConfig(port=0), Authenticator(load_users(USERS)), EngineView(broker))
    try:
        ops = Visitor(console.url)
        assert ops.log_in("ops", PASSWORDS["ops"]) == 303
        status, page = ops.get("/topics")
        assert status == 200
    finally:
        console.stop()
    return {m["topic"]: int(m["bytes"].replace(",", "")) for m in ROW.finditer(page)}


def figures(broker: Broker) -> dict[str, int]:
    return {t.name: t.bytes for t in broker.topics()}


def test_bytes_kept_per_topic_survive_a_restart_and_drop_with_retention(tmp_path: Path) -> None:
    clock = FakeClock()
    config = StoreConfig(flush="none", segment_size=64 * 1024, max_record_size=8 * 1024, retention=3600, clock=clock,
                         checkpoint_interval=0)
    broker = Broker(tmp_path / "broker", store_config=config, clock=clock)
    try:
        payments = publish(broker, "payments", 1000, 60)  # interleaved with orders in the log
        orders = publish(broker, "orders", 10, 40) + publish(broker, "orders", 3000, 5)
        payments += publish(broker, "payments", 1000, 60)
        assert figures(broker) == {"orders": orders, "payments": payments}
        assert on_page(broker, tmp_path) == {"orders": orders, "payments": payments}
    finally:
        broker.close()

    broker = Broker(tmp_path / "broker", store_config=config, clock=clock)
    try:
        assert figures(broker) == on_page(broker, tmp_path) == {"orders": orders, "payments": payments}
        clock.advance(4000)
        later = publish(broker, "payments", 1000, 80)  # rolls segments; the earlier ones expire
        assert broker.store.clean()
        after = figures(broker)
        assert after["payments"] < payments + later and after["orders"] < orders
        kept = sum(FRAME_MIN + len("payments") + len(d.message_id) + len(d.body)
                   for q in range(broker.topics()[1].queues) for d in broker.read("payments", q, 0, 10_000))
        assert after["payments"] == kept
        assert on_page(broker, tmp_path) == after
    finally:
        broker.close()
