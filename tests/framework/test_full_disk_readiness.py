"""Readiness while the store's disk is full, for real: ``/readyz`` says so, and why.

A worker rides out a full store disk by deferring every message it cannot
write, so it stays alive and its transport reachable; before, ``/readyz``
answered 200 all along while nothing got done. The store (SQLite on a small
tmpfs, or PostgreSQL whose tablespace is one) is filled mid-run of `App.run`
on the embedded broker (on the normal disk); a middleware asks ``/readyz``
over HTTP after each pipeline run, as an orchestrator would between them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text
from structlog.testing import capture_logs

from reliable import Middleware
from reliable.health import serve_probes
from reliable.outcome import Outcome, Result
from reliable.testing import test_app
from tests.disk import SpaceComesBack
from tests.framework.conftest import create_effects, effects
from tests.framework.test_health import get

ORDERS = 6
FILL_AT = 2
# Written once the disk is full: SQLite writes a document larger than its page cache during the
# statement (and its WAL must grow for it), PostgreSQL must grow the TOAST table for one.
DOCUMENT = {"sqlite": 3_000_000, "postgresql": 16_000}
REFUSED = {"sqlite": "database or disk is full", "postgresql": "could not extend file"}


class ReadinessSeen(Middleware):
    """``/readyz`` asked after every pipeline run, with whether the disk was full then."""

    def __init__(self, clock: SpaceComesBack) -> None:
        self.clock = clock
        self.port = 0
        self.seen: list[tuple[bool, int, dict[str, Any], list[Outcome]]] = []
        self.gauge: list[float | None] = []  # reliable_store_writes_refused, as a scrape reads it

    def after_messages(self, handler: Any, outcomes: Sequence[tuple[Any, Result | None]]) -> None:
        status, body = get(self.port, "/readyz")
        full = self.clock.ballast is not None and self.clock.ballast.path.exists()
        self.seen.append((full, status, json.loads(body), [r.outcome for _, r in outcomes if r is not None]))
        self.gauge.append(REGISTRY.get_sample_value("reliable_store_writes_refused"))


@pytest.mark.parametrize("shape", ["sync", "async"])
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_readyz_is_503_naming_the_full_disk_while_the_store_refuses_writes(
        request: pytest.FixtureRequest, tmp_path: Path, database: str, shape: str) -> None:
    if database == "sqlite":
        disk: Path = request.getfixturevalue("small_disk")
        store = f"sqlite:///{disk / 'store.db'}"
    else:
        small = request.getfixturevalue("small_postgres")
        disk, store = small.disk, small.url
    clock = SpaceComesBack()
    app = test_app(tmp_path, clock=clock, store=store, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_WORKER__PREFETCH": "1",  # one message a pipeline run
                             "RELIABLE_RETRY__INITIAL_DELAY": "5", "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    create_effects(app, "effects")
    with app.store.transaction() as tx:
        tx.execute(text(f"create table documents (token text, body {'blob' if database == 'sqlite' else 'bytea'})"))
    probe = ReadinessSeen(clock)
    app.add_middleware(probe)

    def writes(msg: Any) -> list[tuple[Any, dict[str, Any]]]:
        if msg.body["id"] == FILL_AT and clock.ballast is None:
            clock.fill(disk)
        effect = (text("insert into effects (token, attempt) values (:t, :a)"),
                  {"t": f"order-{msg.body['id']}", "a": msg.attempt})
        if clock.ballast is None:  # small writes before, a large one from the fill on
            return [effect]
        return [(text("insert into documents values (:t, :b)"),
                 {"t": msg.body["id"], "b": os.urandom(DOCUMENT[database])}), effect]

    if shape == "sync":
        @app.handler("orders", token="body.id")
        def order(msg, tx):
            for statement, parameters in writes(msg):
                tx.execute(statement, parameters)
    else:
        @app.handler("orders", token="body.id")
        async def order(msg, tx):
            for statement, parameters in writes(msg):
                await tx.execute(statement, parameters)

    server = serve_probes(app, 0)
    probe.port = server.server_address[1]
    try:
        for n in range(ORDERS):
            app.publish("orders", {"id": n})
        with capture_logs() as logs:
            app.run(until_idle=True)
        assert clock.ballast is not None and clock.ballast.hit_enospc and not clock.ballast.path.exists()
        assert effects(app) == sorted(f"order-{n}" for n in range(ORDERS))
        before = [(status, gauge) for (full, status, _, _), gauge in zip(probe.seen[: FILL_AT], probe.gauge)
                  if not full]
        during = [(status, body, gauge) for (full, status, body, outcomes), gauge in zip(probe.seen, probe.gauge)
                  if full and outcomes == [Outcome.DEFERRED]]
        assert before and set(before) == {(200, 0.0)}, probe.seen
        assert during, probe.seen  # deferred for the full disk, seen on the probe
        for status, body, gauge in during:
            assert status == 503 and body["store_writes"] is False and gauge == 1.0, (body, gauge)
            assert REFUSED[database] in body["store_refusal"], body
            assert body["running"] and body["transport"], body  # alive and reachable: the disk alone
        turns = [e["event"] for e in logs if e["event"].startswith("store.writes_")]
        assert turns == ["store.writes_refused", "store.writes_accepted"], Counter(turns)  # no flapping
        full, status, body, outcomes = probe.seen[-1]
        assert not full and outcomes == [Outcome.PROCESSED] and status == 200, probe.seen[-1]
        assert probe.gauge[-1] == 0.0
        assert body["store_writes"] is True and "store_refusal" not in body, body
    finally:
        server.shutdown()
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()
