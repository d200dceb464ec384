"""A deterministic simulation: one seed drives producers, members and faults against the engine.

Each step is drawn from the seed: publish (keyed), a member joins, leaves,
crashes (goes silent), fetches, acks, nacks, dead-letters; the clock jumps;
the broker process "dies" (nothing flushed) and recovers, sometimes with a
torn tail written after its last acknowledged append; an fsync fails. After
every step: no queue is held by two members, nothing is delivered that was
never published, and first deliveries of a key come in the key's order. At
the end every acknowledged publish has been delivered and acknowledged at
least once. A failing seed replays exactly: ``SEEDS=<seed> pytest ...``.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import Delivery, OutgoingMessage
from broker.errors import BrokerError, UnknownMemberError
from broker.store import FakeClock, StoreConfig

CI_SEEDS = 200
SOAK_SEEDS = 3000
KEYS = ["k0", "k1", "k2", "k3", "k4"]


@dataclass
class World:
    rng: random.Random
    path: Path
    clock: FakeClock = field(default_factory=FakeClock)
    broker: Broker | None = None
    members: dict[str, list[Delivery]] = field(default_factory=dict)  # live member -> what it holds
    attempted: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (key, seq)
    acknowledged: set[str] = field(default_factory=set)  # publishes the broker confirmed
    done: set[str] = field(default_factory=set)  # acked or dead-lettered by a member
    first_seen: dict[str, list[int]] = field(default_factory=dict)  # key -> seqs in first-delivery order
    seq: dict[str, int] = field(default_factory=dict)
    fsync_fails: bool = False

    def open(self) -> Broker:
        config = DeliveryConfig(queues=2, lease=20.0, session_timeout=60.0, prefetch=8)
        store = StoreConfig(flush="sync", clock=self.clock, segment_size=64 * 1024,
                            max_record_size=8 * 1024, checkpoint_interval=0)
        self.broker = Broker(self.path, config, store_config=store, clock=self.clock)
        self.members = {}  # members of the dead process are gone with it
        return self.broker


def publish(world: World) -> None:
    key = world.rng.choice(KEYS)
    batch = []
    for _ in range(world.rng.randint(1, 4)):
        number = world.seq.get(key, 0)
        world.seq[key] = number + 1
        message_id = f"{key}-{number}"
        world.attempted[message_id] = (key, number)
        batch.append(OutgoingMessage(message_id.encode(), key=key, message_id=message_id))
    try:
        world.broker.publish("orders", batch)  # type: ignore[union-attr]
    except BrokerError:
        restart(world)  # a failed fsync leaves the store needing a reopen
        return
    world.acknowledged.update(m.message_id for m in batch)


def fetch(world: World, member: str) -> None:
    try:
        got = world.broker.fetch(member, world.rng.randint(1, 5), 0)  # type: ignore[union-attr]
    except UnknownMemberError:
        world.members.pop(member)
        return
    for delivery in got:
        assert delivery.message_id in world.attempted, f"never published: {delivery.message_id}"
        key, number = world.attempted[delivery.message_id]
        seen = world.first_seen.setdefault(key, [])
        if number not in seen and delivery.topic == "orders":
            assert not seen or number > max(seen) or number in seen, (key, number, seen)
            seen.append(number)
    world.members[member].extend(got)


def settle(world: World, member: str) -> None:
    held = world.members[member]
    if not held:
        return
    chosen = world.rng.sample(held, world.rng.randint(1, len(held)))
    for delivery in chosen:
        held.remove(delivery)
    how = world.rng.random()
    broker = world.broker
    try:
        if how < 0.7:
            broker.ack(member, [d.receipt for d in chosen])  # type: ignore[union-attr]
            world.done.update(d.message_id for d in chosen)
        elif how < 0.9:
            broker.nack(member, [d.receipt for d in chosen], world.rng.choice([0.0, 1.0, 30.0]))  # type: ignore[union-attr]
        else:
            broker.dead_letter(member, [d.receipt for d in chosen], "simulated poison")  # type: ignore[union-attr]
            world.done.update(d.message_id for d in chosen)
    except UnknownMemberError:
        world.members.pop(member)


def restart(world: World, torn: bool = False) -> None:
    world.broker.abandon()  # type: ignore[union-attr]
    if torn:  # bytes of an append that never completed, after the last acknowledged one
        segment = sorted((world.path / "commitlog").glob("*.log"))[-1]
        size = os.path.getsize(segment)
        with open(segment, "r+b") as log:
            log.seek(size)
            log.write(world.rng.randbytes(world.rng.randint(1, 300)))
    world.open()


def check_no_queue_held_twice(broker: Broker) -> None:
    for group in broker.consuming.membership.group_table.values():
        for key, cursor in group.cursors.items():
            holders = cursor.holders()
            assert len(holders) <= 1, f"{key} held by {holders}"


def step(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    rng, broker = world.rng, world.broker
    assert broker is not None
    roll = rng.random()
    live = sorted(world.members)
    if roll < 0.25:
        publish(world)
    elif roll < 0.32 or not live:
        member = broker.join("g", ["orders"])
        world.members[member] = []
    elif roll < 0.36:
        member = rng.choice(live)
        broker.leave(member)
        world.members.pop(member)
    elif roll < 0.39:
        world.members.pop(rng.choice(live))  # crashed: silent from now on
    elif roll < 0.62:
        fetch(world, rng.choice(live))
    elif roll < 0.85:
        settle(world, rng.choice(live))
    elif roll < 0.93:
        world.clock.advance(rng.choice([0.5, 5.0, 25.0, 70.0]))
    elif roll < 0.97:
        restart(world, torn=rng.random() < 0.5)
    else:
        import broker.store.segment as segment

        real = segment.os.fsync

        def failing(fd: int) -> None:
            monkeypatch.setattr(segment.os, "fsync", real)
            raise OSError(5, "simulated fsync failure")

        monkeypatch.setattr(segment.os, "fsync", failing)
        publish(world)
        monkeypatch.setattr(segment.os, "fsync", real)
    check_no_queue_held_twice(world.broker)  # type: ignore[arg-type]


def finish(world: World) -> None:
    """Stop the chaos: one member drains everything, clock moving past every delay."""
    broker = world.broker
    assert broker is not None
    for member in list(world.members):
        broker.leave(member)
    drainer = broker.join("g", ["orders"])
    for _ in range(200):
        got = broker.fetch(drainer, 50, 0)
        for delivery in got:
            assert delivery.message_id in world.attempted
        broker.ack(drainer, [d.receipt for d in got])
        world.done.update(d.message_id for d in got)
        if not got:
            if broker.pending("g", ["orders"]) == 0:
                break
            world.clock.advance(31.0)
    assert broker.pending("g", ["orders"]) == 0
    world.done.update(d.message_id for d in broker.dlq_list("g", limit=10_000))
    lost = world.acknowledged - world.done
    assert not lost, f"acknowledged but never finished: {sorted(lost)[:10]}"


def simulate(seed: int, path: Path, monkeypatch: pytest.MonkeyPatch, steps: int = 120) -> None:
    world = World(random.Random(seed), path)
    world.open()
    try:
        for _ in range(steps):
            step(world, monkeypatch)
        finish(world)
    finally:
        if world.broker is not None:
            world.broker.close()


def seeds(count: int) -> list[int]:
    chosen = os.environ.get("SEEDS")
    return [int(s) for s in chosen.split(",")] if chosen else list(range(count))


@pytest.mark.parametrize("block", range(10))
def test_simulation_seeds(block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in seeds(CI_SEEDS)[block::10]:
        simulate(seed, tmp_path / f"seed-{seed}", monkeypatch)


@pytest.mark.soak
@pytest.mark.parametrize("block", range(30))
def test_simulation_soak(block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in seeds(SOAK_SEEDS)[block::30]:
        simulate(seed, tmp_path / f"seed-{seed}", monkeypatch, steps=400)
