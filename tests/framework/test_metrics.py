"""A worker's Prometheus metrics, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import urllib.request

from reliable.metrics import serve_metrics
from reliable.testing import test_app


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_outcomes_and_handler_latency_per_handler(tmp_path, unique) -> None:
    app = test_app(tmp_path)
    name = f"charge_{unique}"

    @app.handler("payments", name=name, group="billing", token="body.id", fatal=(ValueError,))
    def charge(msg):
        if msg.body.get("bad"):
            raise ValueError("bad amount")

    app.publish_many("payments", [{"id": "a"}, {"id": "b"}, {"id": "a"}, {"id": "c", "bad": True}])
    app.run(until_idle=True)
    text = scrape(serve_metrics(0))
    assert f'reliable_messages_total{{handler="{name}",outcome="processed"}} 2.0' in text
    assert f'reliable_messages_total{{handler="{name}",outcome="duplicate"}} 1.0' in text
    assert f'reliable_messages_total{{handler="{name}",outcome="dead_lettered"}} 1.0' in text
    assert f'reliable_handler_seconds_count{{handler="{name}"}} 3.0' in text  # the duplicate never ran
    app.close()


def test_consumer_lag_is_a_gauge_per_handler_and_topic(app) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import REGISTRY

    seen: list[int] = []

    @app.handler("lagging", token="body.n", prefetch=1)
    def lagging(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(msg.body["n"])
        if len(seen) == 1:
            app.stop()  # the first run ends after the first message: four are left

    app.publish_many("lagging", [{"n": n} for n in range(5)])
    app.run()
    labels = {"handler": "lagging", "topic": "lagging"}
    assert REGISTRY.get_sample_value("reliable_consumer_lag", labels) == 4
    app.run(until_idle=True)
    assert REGISTRY.get_sample_value("reliable_consumer_lag", labels) == 0
