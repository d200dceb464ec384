"""The framework's handlers on ``reliable://``: the broker server in a process of its own.

The same handler code as on ``embedded://``: idempotency in the handler's
transaction (PostgreSQL), redelivery with the policy's delay counted by the
broker, one dead letter per poison message, and a worker that survives the
server being killed with ``kill -9`` and restarted on the same port.
"""

from __future__ import annotations

import threading

from sqlalchemy import create_engine, text

from reliable import App
from reliable.settings import Settings
from tests.broker.server.serving import ServerProcess
from tests.waiting import wait_until

WAIT = 120.0


def make_app(url: str, postgres_url: str, table: str) -> App:
    env = {"RELIABLE_TRANSPORT__URL": url, "RELIABLE_STORE__URL": postgres_url,
           "RELIABLE_CACHE__URL": "memory://", "RELIABLE_RETRY__INITIAL_DELAY": "0.2",
           "RELIABLE_RETRY__JITTER": "0", "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
           "RELIABLE_LOG__LEVEL": "warning"}
    app = App(Settings.load(None, env=env))
    with app.store.transaction() as tx:
        tx.execute(text(f"create table if not exists {table} (token text, attempt integer)"))

    @app.handler(table, group=f"g-{table}", token="body.token", fatal=(ValueError,))
    def handle(msg, tx):
        if msg.body.get("poison"):
            raise ValueError("never")
        if msg.body.get("flaky") and msg.attempt == 1:
            raise ConnectionError("try again")
        tx.execute(text(f"insert into {table} (token, attempt) values (:t, :a)"),
                   {"t": msg.body["token"], "a": msg.attempt})

    return app


def rows(postgres_url: str, table: str) -> list[tuple[str, int]]:
    engine = create_engine(postgres_url)
    with engine.connect() as connection:
        found = [tuple(r) for r in connection.execute(text(f"select token, attempt from {table} order by token"))]
    engine.dispose()
    return found  # type: ignore[return-value]


def test_handlers_run_unchanged_on_the_broker_server(reliable_server, postgres_url, unique):
    app = make_app(reliable_server.url, postgres_url, unique)
    bodies = [{"token": f"t{n}"} for n in range(50)]
    app.publish_many(unique, bodies + bodies[:10] + [{"token": "p", "poison": True}] * 2
                     + [{"token": "f", "flaky": True}])
    app.run(until_idle=True)
    found = rows(postgres_url, unique)
    assert sorted(t for t, _ in found) == sorted([f"t{n}" for n in range(50)] + ["f"])
    assert ("f", 2) in found  # redelivered by the broker, its delivery count raised
    assert [letter.token for letter in app.dead_letters(f"g-{unique}")] == ["p"]
    stats = app.stats()
    assert (stats["processed"], stats["duplicate"], stats["dead_lettered"]) == (51, 11, 1)
    app.close()


def test_a_worker_rides_out_the_server_killed_and_restarted(tmp_path, postgres_url, unique):
    server = ServerProcess(tmp_path / "data").start()
    app = make_app(server.url, postgres_url, unique)
    app.publish_many(unique, [{"token": f"t{n}"} for n in range(300)])
    worker = threading.Thread(target=app.run, daemon=True)
    worker.start()
    wait_until(lambda: len(rows(postgres_url, unique)) >= 50, "50 of 300 effects", WAIT)
    server.kill()  # mid-run: connections cut, unacknowledged work in flight
    server = ServerProcess(tmp_path / "data", port=server.port).start()
    wait_until(lambda: len(rows(postgres_url, unique)) >= 300, "all 300 effects after the restart", WAIT)
    app.stop()
    worker.join(timeout=60)
    found = rows(postgres_url, unique)
    assert sorted(t for t, _ in found) == sorted(f"t{n}" for n in range(300))  # each once
    server.stop()
    app.close()
