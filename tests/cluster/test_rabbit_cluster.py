"""Handlers ride through the quorum queue's leader being killed in a 3-node RabbitMQ cluster.

The cluster is the machine's ``rabbitmq-server`` started three times on
loopback by the test (`RabbitCluster`: own node names, ports and mnesia
directories; the shared server is never touched). During one run
(`tests.cluster.run`) the node leading the group's quorum queue is killed
with ``kill -9`` and restarted, then a follower. The clients list every node
(``[transport] servers``), so those connected to the killed node reconnect to
another. Every effect must be in PostgreSQL once and every poison message
dead-lettered once; the killed leader is shown to lead no more afterwards.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.errors import TransportError
from backends.transport.amqp_layout import Layout
from backends.transport.amqp_transport import AmqpTransport
from reliable import App
from reliable.settings import Settings
from tests.cluster.rabbit_cluster import RabbitCluster
from tests.cluster.run import ClusterRun, Failure


@pytest.fixture(scope="module")
def rabbit_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitCluster]:
    """One cluster for the module's tests (each on queues of its own; a test restarts what it killed):
    starting three nodes and joining them costs 50-100 s. `tests.scheduling` keeps the module on one
    worker, so the cluster is started once."""
    with RabbitCluster(tmp_path_factory.mktemp("rabbit"), f"t{uuid.uuid4().hex[:12]}") as cluster:
        yield cluster


def rabbit_run(cluster: RabbitCluster, postgres_url: str, effects: str, topic: str, count: int, log_dir: Path,
               rounds: int) -> ClusterRun:
    queue = Layout(topic).queue(topic, topic)
    first = cluster.nodes[0]

    def kill_leader() -> str:
        node = cluster.leader(queue)
        cluster.kill(node)
        assert cluster.leader(queue) != node  # a new leader was elected
        return node.partition("@")[0].removeprefix(cluster.name)

    def kill_follower() -> str:
        leader = cluster.leader(queue)
        node = next(n for n in cluster.nodes if n != leader)
        cluster.kill(node)
        return node.partition("@")[0].removeprefix(cluster.name)

    def restart(letter: str) -> None:
        cluster.start(f"{cluster.name}{letter}@localhost")

    kinds = [("kill -9 quorum queue leader", kill_leader), ("kill -9 follower", kill_follower)]
    steps = [kinds[i % len(kinds)] for i in range(len(kinds) * rounds)]
    failures = [Failure(name, (i + 1) / (len(steps) + 1), inject, restart) for i, (name, inject) in enumerate(steps)]
    env = {
        "RELIABLE_TRANSPORT__URL": f"{cluster.url(first)}?namespace={topic}&connect_timeout=3",
        "RELIABLE_TRANSPORT__SERVERS": str(cluster.servers(first)).replace("'", '"'),
        "RELIABLE_TRANSPORT__REPLICAS": "3",
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": "5",
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": "memory://",
        "RELIABLE_COMMIT__STRATEGY": "transactional",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    }
    return ClusterRun(env, postgres_url, effects, topic, count, log_dir, failures)


def test_quorum_queue_rides_through_kill_9_of_its_leader_and_a_follower(
    rabbit_cluster: RabbitCluster, postgres_url: str, effects: str, unique: str, tmp_path: Path
) -> None:
    rabbit_run(rabbit_cluster, postgres_url, effects, unique, 3000, tmp_path, rounds=1).run()
    with AmqpTransport(rabbit_cluster.url(rabbit_cluster.nodes[0]), namespace=unique, replicas=1) as transport, \
            pytest.raises(TransportError, match="inequivalent arg 'x-quorum-initial-group-size'"):
        transport.declare(unique, [unique])  # the queue has 3 members: a size of 1 is refused, naming it


def test_every_publish_confirmed_while_the_leader_is_down_is_kept(
    rabbit_cluster: RabbitCluster, unique: str, tmp_path: Path
) -> None:
    """With the quorum queue's leader killed, RabbitMQ 3.10 answered ``tx.commit-ok`` for batches it had
    dropped (1,000 to 2,450 messages per 3 s); under publisher confirms (a batch's in flight together)
    the same publishes are nacked or cut instead, and `App.publish_many` sends them again."""
    cluster, first = rabbit_cluster, rabbit_cluster.nodes[0]
    queue = Layout(unique).queue(unique, unique)
    app = App(Settings.load(None, env={
        "RELIABLE_TRANSPORT__URL": f"{cluster.url(first)}?namespace={unique}&connect_timeout=3",
        "RELIABLE_TRANSPORT__SERVERS": json.dumps(cluster.servers(first)),
        "RELIABLE_TRANSPORT__REPLICAS": "3",
        "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
        "RELIABLE_CACHE__URL": "memory://",
    }))
    sent: list[int] = []

    def publish(seconds: float) -> int:
        """Batches of 50 for ``seconds``; how many messages were confirmed."""
        before, ends = len(sent), time.monotonic() + seconds
        while time.monotonic() < ends:
            batch = list(range(len(sent), len(sent) + 50))
            app.publish_many(unique, [{"n": n} for n in batch])
            sent.extend(batch)
        return len(sent) - before

    try:
        app.transport.declare(unique, [unique])
        publish(1.0)
        leader = cluster.leader(queue)
        cluster.kill(leader)  # the publisher's node too: it reconnects to another
        assert publish(3.0) > 0, "nothing was confirmed while the leader was down"
        cluster.start(leader)
        received: set[int] = set()
        subscription = app.transport.subscribe(unique, [unique])
        while messages := subscription.fetch(500, 2.0):
            received.update(json.loads(m.payload)["n"] for m in messages)
            subscription.ack(messages)
        subscription.close()
    finally:
        app.close()
    assert sorted(set(sent) - received) == []


@pytest.mark.soak
def test_soak_quorum_queue_rides_through_many_kills(
    rabbit_cluster: RabbitCluster, postgres_url: str, effects: str, unique: str, tmp_path: Path
) -> None:
    rabbit_run(rabbit_cluster, postgres_url, effects, unique, 20000, tmp_path, rounds=4).run()
