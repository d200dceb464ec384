"""The kill -9 chaos run every transport's framework suite shares.

A producer publishes ``count`` tokens (1% poison, 10% sent twice, shuffled)
while framework workers (`tests.transports.chaos_worker`) are started one
after another and each killed with SIGKILL at a random point of the work's
progress and a random moment after it; the producer sends its last messages
only after the last kill, so every kill lands while there is work left
(`tests.transports.kill_points`). A last worker finishes the work. Then
every token's side effect must be in PostgreSQL exactly once and every
poison token dead-lettered exactly once.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from reliable import App
from reliable.settings import Settings
from tests import forked
from tests.transports import chaos_worker
from tests.transports.effects import (
    dead_letter_counts,
    effect_counts,
    effects_and_dead_letters,
    wait_until,
)
from tests.transports.kill_points import JITTER, held_back, points

ROOT = Path(__file__).resolve().parents[2]


def kill_9_chaos(env: Mapping[str, str], postgres_url: str, effects: str, topic: str, kills: int, count: int,
                 handler: str = "batch") -> None:
    """Run the chaos described above on the transport ``env`` configures, with the worker's
    ``handler`` (`tests.transports.chaos_worker`: ``batch``, or ``async``); assert its outcome."""
    tokens = [f"t{n}" for n in range(count)]
    poison = set(random.Random(14).sample(tokens, count // 100))
    bodies = [{"token": t, "poison": t in poison} for t in tokens]
    bodies += random.Random(15).sample(bodies, count // 10)  # 10% duplicates
    random.Random(16).shuffle(bodies)
    env = {**env, "PYTHONPATH": str(ROOT)}
    producer = App(Settings.load(None, env=env))
    producer.transport.declare(topic, [topic])  # a queue broker keeps messages for known groups only
    producer.store.count_dead_letters(topic)  # the store's tables exist before `done` reads them

    def send(part: Sequence[dict]) -> None:
        for i in range(0, len(part), 500):
            producer.publish_many(topic, part[i : i + 500])

    head, tail = held_back(bodies)
    sending = threading.Thread(target=send, args=(head,))
    sending.start()

    def start() -> BaseProcess:  # forked from a process that imported the worker already
        return forked.start(chaos_worker.main, (effects, topic, topic, handler), env, ROOT)

    def done() -> int:
        return effects_and_dead_letters(postgres_url, effects, topic)

    rng, work = random.Random(), len({body["token"] for body in head})
    landed: list[int] = []  # the progress after each kill
    try:
        for point in points(kills, work, rng):
            target = min(max(point, done() + 1), work)  # and after some work of this worker's
            worker = start()
            try:
                wait_until(lambda: done() >= target, worker.is_alive, 0.05)  # noqa: B023
                time.sleep(rng.uniform(0, JITTER))  # and at a random moment after it
            finally:  # a failed wait must not leave a worker consuming after the test
                worker.kill()
            worker.join(timeout=30)
            assert worker.exitcode == -signal.SIGKILL
            landed.append(done())  # at least what it was at the kill
        sending.join()
        send(tail)  # only now can the work end
        survivor = start()
        try:
            wait_until(lambda: done() >= len(tokens), survivor.is_alive)
        finally:
            survivor.terminate()
            survivor.join(timeout=60)
            if survivor.is_alive():  # SIGTERM did not end it: the test fails, and leaves no worker behind
                survivor.kill()
                raise AssertionError("the last worker did not stop on SIGTERM within 60 s")
    finally:
        sending.join()
        producer.close()
    assert len(landed) == kills and all(n < len(tokens) for n in landed), \
        "the kills landed while tokens were still being processed"
    print(f"chaos {topic}: {sum(n < work for n in landed)} kills with work sent left, at progress {landed}")
    assert effect_counts(postgres_url, effects) == {t: 1 for t in tokens if t not in poison}
    # each poison token dead-lettered once: its duplicates (and its redeliveries after a kill)
    # find the record written and are acked as duplicates
    assert dead_letter_counts(postgres_url, topic) == {t: 1 for t in poison}
    assert sum(1 for b in bodies if b["poison"]) > len(poison)  # duplicates of poison messages were sent
