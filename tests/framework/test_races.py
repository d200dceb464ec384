"""Twins really at the same time: eight threads with one token, and PostgreSQL shows one waited.

The first twin to claim the token holds its transaction open inside the
handler until a watcher sees, in ``pg_stat_activity``, another backend of
this database waiting on a lock while inserting into the token table: the
unique index made the twin wait. Then the holder commits, the waiting twins
find the token and are skipped. With the cache cold, and with it warm (Redis
already holding other tokens of the group; a repeat after the commit is
answered by the cache alone, with no claim).
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import create_engine, text

from reliable import Message
from reliable.testing import test_app

# a backend of this database waiting for another transaction: the twin's insert into the token
# table's unique index waits for the holder's uncommitted row (its statement text may be empty:
# the claim goes through psycopg's pipeline; a third twin queues on the row's tuple lock)
WAITING = """
select count(*) from pg_stat_activity a join pg_locks l on l.pid = a.pid and not l.granted
where a.datname = current_database() and l.locktype in ('transactionid', 'tuple')
"""
PATIENCE = 60  # seconds the holder and the watcher wait: eight workers start slowly on a loaded machine


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_eight_twins_one_waits_on_the_unique_index_and_one_effect(
    tmp_path, postgres_url, redis_url, unique, cache
) -> None:
    observed = threading.Event()
    effects: list[str] = []
    apps = []
    for number in range(8):  # eight workers, each with its own copy of the message
        app = test_app(tmp_path / f"w{number}", store=postgres_url, cache=redis_url)
        if cache == "warm" and number == 0:
            app.runtime.cache.remember(unique, [f"other-{n}" for n in range(100)], 600)  # type: ignore[union-attr]

        @app.handler("work", group=unique, token="body.token")
        def handle(msg: Message, tx, worker: int = number) -> None:
            observed.wait(PATIENCE)  # hold the claim until a twin is seen waiting on it
            effects.append(f"w{worker}")

        app.publish("work", {"token": "twin"})
        apps.append(app)

    def watch() -> None:
        engine = create_engine(postgres_url)
        deadline = time.monotonic() + PATIENCE
        with engine.connect() as connection:
            while time.monotonic() < deadline and not observed.is_set():
                if connection.execute(text(WAITING)).scalar():
                    observed.set()
                connection.rollback()  # pg_stat_activity is read once per transaction: a fresh one each poll
                time.sleep(0.01)
        engine.dispose()

    threads = [threading.Thread(target=watch)] + [
        threading.Thread(target=app.run, kwargs={"until_idle": True}) for app in apps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert observed.is_set(), "no twin was seen waiting on the unique index"
    assert len(effects) == 1  # one side effect
    stats = [app.stats() for app in apps]
    assert (sum(s["processed"] for s in stats), sum(s["duplicate"] for s in stats)) == (1, 7)

    late = apps[0]  # after the commit, a repeat is answered by the cache: no claim, no wait
    late.publish("work", {"token": "twin"})
    late.run(until_idle=True)
    assert len(effects) == 1 and late.stats()["duplicate"] == stats[0]["duplicate"] + 1
    for app in apps:
        app.close()
