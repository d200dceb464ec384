"""Handlers ride through node failures of a 3-node NATS JetStream cluster (R3 streams).

The cluster is the machine's ``nats-server`` started three times on loopback
by the test. During one run (`tests.cluster.run`) the node leading the topic's
stream, then the node leading the group's consumer, then a follower are
killed with ``kill -9`` and restarted; every effect must be in PostgreSQL once
and every poison message dead-lettered once. Each kill is shown to have hit
what it meant to: the killed leader is no longer the leader afterwards (an
election took place), the follower's kill left the leader in place.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
from nats.js.api import RetentionPolicy, StreamConfig
from structlog.testing import capture_logs

from backends.errors import BackendUnavailableError, ConfigurationError
from backends.transport.nats_layout import Layout
from backends.transport.nats_transport import NatsTransport
from reliable import App
from reliable.settings import Settings
from tests.cluster.nats_cluster import NatsCluster
from tests.cluster.run import ClusterRun, Failure


def nats_run(cluster: NatsCluster, postgres_url: str, redis_url: str, effects: str, topic: str, count: int,
             log_dir: Path, rounds: int) -> ClusterRun:
    layout = Layout(topic)
    stream, (consumer, _) = layout.stream(topic), layout.consumers(topic)

    def kill_leader(of: str | None) -> str:
        node = cluster.leader(stream, of)
        cluster.kill(node)
        assert cluster.leader(stream, of) != node  # a new leader was elected
        return node

    def kill_follower() -> str:
        leaders = {cluster.leader(stream), cluster.leader(stream, consumer)}
        node = next(n for n in cluster.nodes if n not in leaders)
        cluster.kill(node)
        assert cluster.leader(stream) in leaders
        return node

    def restart(node: str) -> None:
        cluster.start(node)
        cluster.wait_current(node)

    kinds = [("kill -9 stream leader", lambda: kill_leader(None)),
             ("kill -9 consumer leader", lambda: kill_leader(consumer)),
             ("kill -9 follower", kill_follower)]
    steps = [kinds[i % len(kinds)] for i in range(len(kinds) * rounds)]
    failures = [Failure(name, (i + 1) / (len(steps) + 1), inject, restart) for i, (name, inject) in enumerate(steps)]
    env = {
        "RELIABLE_TRANSPORT__URL": f"{cluster.url}?namespace={topic}",
        "RELIABLE_TRANSPORT__REPLICAS": "3",
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": "5",
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": redis_url,
        "RELIABLE_CACHE__PREFIX": topic,
        "RELIABLE_COMMIT__STRATEGY": "transactional",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    }
    return ClusterRun(env, postgres_url, effects, topic, count, log_dir, failures,
                      describe=lambda: cluster.describe(stream, consumer))


def test_r3_stream_rides_through_kill_9_of_leaders_and_a_follower(
    nats_cluster: NatsCluster, postgres_url: str, redis_url: str, effects: str, unique: str, tmp_path: Path
) -> None:
    run = nats_run(nats_cluster, postgres_url, redis_url, effects, unique, 3000, tmp_path, rounds=1)
    run.run()
    assert nats_cluster.replicas(Layout(unique).stream(unique)) == 3


@pytest.mark.soak
def test_soak_r3_stream_rides_through_many_kills(
    nats_cluster: NatsCluster, postgres_url: str, redis_url: str, effects: str, unique: str, tmp_path: Path
) -> None:
    nats_run(nats_cluster, postgres_url, redis_url, effects, unique, 20000, tmp_path, rounds=4).run()


def test_an_r1_stream_is_updated_to_the_replicas_the_settings_ask_for(nats_cluster: NatsCluster, unique: str) -> None:
    stream = Layout(unique).stream("orders")
    with NatsTransport(nats_cluster.url, namespace=unique) as transport:
        transport.ensure_stream("orders")
    assert nats_cluster.replicas(stream) == 1
    with NatsTransport(nats_cluster.url, namespace=unique, replicas=3) as transport:
        transport.ensure_stream("orders")
    assert nats_cluster.replicas(stream) == 3


def test_a_stream_jetstream_cannot_change_is_refused_naming_the_difference(
    nats_cluster: NatsCluster, unique: str
) -> None:
    layout = Layout(unique)
    config = StreamConfig(name=layout.stream("orders"), subjects=layout.stream_subjects("orders"),
                          retention=RetentionPolicy.WORK_QUEUE)

    async def add() -> None:
        client = await nats.connect(nats_cluster.servers)
        await client.jetstream().add_stream(config)
        await client.close()

    asyncio.run(add())
    with NatsTransport(nats_cluster.url, namespace=unique, replicas=3) as transport, \
            pytest.raises(ConfigurationError, match=r"retention workqueue \(the settings want limits\)"):
        transport.ensure_stream("orders")
    assert nats_cluster.replicas(layout.stream("orders")) == 1  # left as it was


def test_publish_without_a_quorum_retries_within_the_bound_then_raises_the_outage(
    nats_cluster: NatsCluster, unique: str, tmp_path: Path
) -> None:
    env = {"RELIABLE_TRANSPORT__URL": f"{nats_cluster.url}?namespace={unique}&request_timeout=1",
           "RELIABLE_TRANSPORT__REPLICAS": "3", "RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "3",
           "RELIABLE_STORE__URL": f"sqlite:///{tmp_path}/store.db", "RELIABLE_CACHE__URL": "none"}
    app = App(Settings.load(None, env=env))
    try:
        app.publish(unique, {"token": "before"})
        survivor = nats_cluster.leader(Layout(unique).stream(unique))
        for node in nats_cluster.nodes:
            if node != survivor:
                nats_cluster.kill(node)  # two of three replicas gone: no quorum, no write
        with capture_logs() as logs, pytest.raises(BackendUnavailableError):
            app.publish(unique, {"token": "during"})
        assert len([e for e in logs if e["event"] == "publish_retried"]) >= 2
    finally:
        app.close()
