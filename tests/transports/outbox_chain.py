"""The consume-transform-produce chain through the outbox, under kill -9, on any transport.

A producer publishes ``count`` tokens to ``NAME-a`` (10% sent twice, shuffled,
spread over `KEYS` keys). A's worker (`tests.transports.outbox_chain_worker`)
forwards each one to ``NAME-b`` with ``tx.publish`` and relays the outbox
itself; a standalone relay (``reliable relay``) relays it too; B's worker
records every token it gets. The A worker and the relay are killed with
SIGKILL, each kill at a random point of its victim's progress (tokens A
forwarded, outbox rows sent) and a random moment after it, and started
again; the producer sends its last messages only after the last kill, so
every kill lands while the chain is working (`tests.transports.kill_points`).
Then:

* every token's B effect is in PostgreSQL exactly once (none lost, none
  twice: neither A's duplicates, nor a relay's resend after a kill between a
  publish and its commit);
* the outbox holds one row per token, all sent;
* per key, B committed the messages in the order of their outbox rows.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from reliable import App
from reliable.settings import Settings
from tests import forked
from tests.transports import outbox_chain_worker
from tests.transports.effects import query, wait_until
from tests.transports.kill_points import JITTER, held_back, points

ROOT = Path(__file__).resolve().parents[2]
KEYS = 40


def outbox_chain_with_kills(env: Mapping[str, str], postgres_url: str, name: str, kills: int, count: int) -> None:
    """Run the chain described above on the transport ``env`` configures; assert its outcome."""
    try:
        _chain(env, postgres_url, name, kills, count)
    finally:
        query(postgres_url, f"drop table if exists {name}_b")


def _chain(env: Mapping[str, str], postgres_url: str, name: str, kills: int, count: int) -> None:
    tokens = [f"t{n}" for n in range(count)]
    keys = {t: f"k{n % KEYS}" for n, t in enumerate(tokens)}
    sent = tokens + random.Random(21).sample(tokens, count // 10)
    random.Random(22).shuffle(sent)
    env = {**env, "PYTHONPATH": str(ROOT), "RELIABLE_OUTBOX__NAME": name}
    query(postgres_url, f"create table {name}_b (id bigserial primary key, token text, message_id text, key text)")
    producer = App(Settings.load(None, env=env))
    for topic in (f"{name}-a", f"{name}-b"):  # a queue broker keeps messages for known groups only
        producer.transport.declare(topic, [topic])

    def send(part: Sequence[str]) -> None:
        for i in range(0, len(part), 500):
            for key in sorted({keys[t] for t in part[i : i + 500]}):
                producer.publish_many(f"{name}-a", [{"token": t} for t in part[i : i + 500] if keys[t] == key], key=key)

    logs = Path(tempfile.mkdtemp(prefix=f"{name}-chain-"))

    started = itertools.count()

    def log(role: str) -> Path:  # a file per process started, in the order they started
        return logs / f"{role}-{next(started)}.log"

    # A's worker and the relay, killed and started again and again, are forked from a process that
    # imported them already (`tests.forked`); B's worker runs once, its counters read at the end
    def a_worker() -> BaseProcess:
        return forked.start(outbox_chain_worker.main, ("a", name), env, ROOT, log("a"))

    def relay() -> BaseProcess:
        return forked.start(forked.run_cli, ("relay",), env, ROOT, log("relay"))

    def done() -> int:
        return int(query(postgres_url, f"select count(distinct token) from {name}_b")[0][0])

    def progress(victim: str) -> int:  # A's: the tokens it forwarded (a row each); the relay's: the rows sent
        sent = "(select count(*) from reliable_outbox_sent_rows where outbox = :n)"
        unsent = "(select count(*) from reliable_outbox where outbox = :n)"
        return int(query(postgres_url, f"select {sent}" if victim == "relay" else f"select {sent} + {unsent}",
                         n=name)[0][0])

    head, tail = held_back(sent)
    sending = threading.Thread(target=send, args=(head,))
    sending.start()
    b_worker = subprocess.Popen([sys.executable, "-m", "tests.transports.outbox_chain_worker", "b", name], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=log("b").open("w"), text=True)
    running = {"a": a_worker(), "relay": relay()}
    rng, work = random.Random(), len(set(head))
    landed: list[tuple[str, int, int]] = []  # per kill: its victim, the victim's progress and B's, after it

    def alive() -> bool:  # none of the processes ended on its own
        return b_worker.poll() is None and all(process.is_alive() for process in running.values())

    try:
        for point in points(kills, work, rng):
            victim = rng.choice(sorted(running))
            target = min(max(point, progress(victim) + 1), work)  # and after some work of the victim's
            wait_until(lambda: progress(victim) >= target, alive, 0.05)  # noqa: B023
            time.sleep(rng.uniform(0, JITTER))  # and at a random moment after it
            running[victim].kill()
            running[victim].join(timeout=30)
            assert running[victim].exitcode == -signal.SIGKILL
            landed.append((victim, progress(victim), done()))  # at least what they were at the kill
            running[victim] = a_worker() if victim == "a" else relay()
        sending.join()
        send(tail)  # only now can the chain finish
        wait_until(lambda: done() >= count, alive)
    except AssertionError:
        for log in sorted(logs.iterdir()):  # what the processes said, for the failure's report
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")
        raise
    finally:
        sending.join()
        for process in running.values():
            process.terminate()
        b_worker.send_signal(signal.SIGTERM)
        b_out, _ = b_worker.communicate(timeout=120)
        for process in running.values():
            process.join(timeout=120)
            if process.is_alive():  # SIGTERM did not end it: fail, and leave no process behind
                process.kill()
                raise AssertionError("a worker or the relay did not stop on SIGTERM within 120 s")
        producer.close()
    assert len(landed) == kills and all(b < count for _, _, b in landed), \
        "the kills landed while the chain was still working"
    killed = Counter(victim for victim, _, _ in landed)
    assert killed["a"] and killed["relay"], killed

    effects = dict(query(postgres_url, f"select token, count(*) from {name}_b group by token"))
    assert effects == dict.fromkeys(tokens, 1)  # every B effect exactly once, none lost
    rows = dict(query(postgres_url, "select message_id, id from reliable_outbox_sent_rows where outbox = :n", n=name))
    assert len(rows) == count  # one row per token: A's duplicates published nothing
    order: dict[str, list[int]] = {}
    for message_id, key in query(postgres_url, f"select message_id, key from {name}_b order by id"):
        order.setdefault(key, []).append(rows[message_id])
    assert set(order) == set(keys.values())
    assert all(ids == sorted(ids) for ids in order.values())  # per key, in outbox order
    stats = json.loads(b_out.strip().splitlines()[-1])
    busy = sum(own < work for _, own, _ in landed)
    print(f"outbox chain {name}: kills {dict(killed)}, {busy} with their victim's work left, at B's progress "
          f"{[b for _, _, b in landed]} of {count}; B duplicates skipped {stats.get('duplicate', 0)}")
