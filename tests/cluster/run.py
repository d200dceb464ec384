"""A run through node failures, shared by every engine's cluster test.

A producer (an `App` in the test process, ``app.publish`` riding through
outages) publishes ``count`` tokens, 1% poison and 10% sent twice, shuffled,
staying at most `AHEAD` messages ahead of the consumer so that publishing
goes on while nodes fail, pausing while a failed node is restarted, and never
more than `AHEAD` beyond the next failure's share before it is injected (so
that work is left for it however long injecting the one before took). One framework worker in a process of its own
(`tests.transports.chaos_worker`: transactional commits, PostgreSQL store,
batches of 50) consumes them. When progress reaches each failure's share of
the work, the failure is injected (a node killed, a broker set down) and,
once the worker has committed `RESUMED` more effects, undone (the node
restarted). At the end every token's effect must be in PostgreSQL exactly
once and every poison token dead-lettered exactly once.

Recovery time is printed, never asserted: the seconds from the failure until
the worker had committed `RESUMED` effects more than at the failure.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from reliable import App
from reliable.settings import Settings
from tests.transports.effects import (
    dead_letter_count,
    dead_letter_counts,
    effect_count,
    effect_counts,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
AHEAD = 600
"""Tokens the producer may publish beyond those the worker has done (so publishing overlaps the failures)."""
RESUMED = 100
"""Effects committed after a failure that show the worker is through it (two batches of 50)."""
BATCH = 50


@dataclass
class Failure:
    """One failure to inject once ``at`` (a share of the work) is done."""

    name: str
    at: float
    inject: Callable[[], str]
    """Inflicts the failure; returns what it hit (the node), for the printed table."""
    restore: Callable[[str], None]
    """Undoes it (restarts what ``inject`` hit) and waits until that is back."""
    hit: str = ""
    recovery: float = 0.0
    done_at_injection: int = 0


@dataclass
class ClusterRun:
    """The run described above on the cluster ``env`` configures."""

    env: Mapping[str, str]
    postgres_url: str
    effects: str
    topic: str
    count: int
    log_dir: Path
    failures: Sequence[Failure]
    describe: Callable[[], str] = lambda: ""
    """The engine's own view of the group (consumer state), printed when a wait runs out."""
    published: int = 0
    errors: list[BaseException] = field(default_factory=list)
    restoring: threading.Event = field(default_factory=threading.Event)
    """Set while a failure is undone: the producer waits, so work is left for the next failure."""
    allowed: int = 0
    """Tokens the producer may publish until the next failure is injected: `AHEAD` beyond its share."""

    def __post_init__(self) -> None:
        tokens = [f"t{n}" for n in range(self.count)]
        self.tokens = tokens
        self.poison = set(random.Random(14).sample(tokens, self.count // 100))
        bodies = [{"token": t, "poison": t in self.poison} for t in tokens]
        bodies += random.Random(15).sample(bodies, self.count // 10)
        random.Random(16).shuffle(bodies)
        self.bodies = bodies

    def done(self) -> int:
        """Tokens with their effect or their dead letter in PostgreSQL."""
        return effect_count(self.postgres_url, self.effects) + dead_letter_count(self.postgres_url, self.topic)

    def run(self) -> None:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}, **self.env,
               "PYTHONPATH": str(ROOT)}
        producer = App(Settings.load(None, env=env))
        producer.transport.declare(self.topic, [self.topic])
        with producer.store.transaction():
            pass  # creates the store's tables, which `done()` counts in from the start
        sending = threading.Thread(target=self._send, args=(producer,), daemon=True)
        worker_log = (self.log_dir / "worker.log").open("wb")
        worker = subprocess.Popen(
            [sys.executable, "-m", "tests.transports.chaos_worker", self.effects, self.topic, self.topic],
            cwd=ROOT, env=env, stdout=worker_log, stderr=subprocess.STDOUT)
        sending.start()
        try:
            for failure in self.failures:
                self.allowed = int(failure.at * self.count) + AHEAD
                self._explained(lambda: self._inflict(failure, lambda: worker.poll() is None))  # noqa: B023
            self.allowed = self.count
            self._explained(lambda: wait_until(lambda: self.done() >= self.count, lambda: worker.poll() is None))
            sending.join(timeout=60)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
            worker_log.close()
            producer.close()
        assert not self.errors, f"the producer failed: {self.errors!r}"
        self._report()
        assert effect_counts(self.postgres_url, self.effects) == {t: 1 for t in self.tokens if t not in self.poison}
        assert dead_letter_counts(self.postgres_url, self.topic) == {t: 1 for t in self.poison}

    def _explained(self, wait: Callable[[], None]) -> None:
        """``wait()``; a wait that runs out names the progress and the engine's view of the group."""
        try:
            wait()
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.done()} of {self.count} done, {self.published} published; "
                                 f"{self.describe()}") from exc

    def outages_seen(self) -> int:
        """How many times the worker logged the transport as unavailable (it rode through each)."""
        return (self.log_dir / "worker.log").read_text(errors="replace").count("transport_unavailable")

    def _inflict(self, failure: Failure, alive: Callable[[], bool]) -> None:
        wait_until(lambda: self.done() >= failure.at * self.count, alive, 0.05)
        failure.done_at_injection = before = self.done()
        assert before < self.count, f"{failure.name}: the work was over before the failure"
        started = time.monotonic()
        failure.hit = failure.inject()
        wait_until(lambda: self.done() >= min(before + RESUMED, self.count), alive, 0.05)
        failure.recovery = time.monotonic() - started
        self.restoring.set()
        try:
            failure.restore(failure.hit)
        finally:
            self.restoring.clear()

    def _send(self, producer: App) -> None:
        sent: set[str] = set()  # tokens published: what the worker's progress is measured against
        try:
            for start in range(0, len(self.bodies), BATCH):
                wait_until(lambda: not self.restoring.is_set() and len(sent) < self.allowed
                           and len(sent) - self.done() < AHEAD)
                batch = self.bodies[start:start + BATCH]
                producer.publish_many(self.topic, batch)
                self.published += len(batch)
                sent.update(str(body["token"]) for body in batch)
        except BaseException as exc:
            self.errors.append(exc)
            raise

    def _report(self) -> None:
        print(f"\n{self.count} tokens ({len(self.bodies)} messages, {len(self.poison)} poison); "
              f"worker outages ridden through: {self.outages_seen()}")
        print(f"{'failure':<32}{'node':<10}{'at effect':>10}{'recovery s':>12}")
        for failure in self.failures:
            print(f"{failure.name:<32}{failure.hit:<10}{failure.done_at_injection:>10}{failure.recovery:>12.2f}")
