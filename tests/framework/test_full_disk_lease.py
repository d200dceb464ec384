"""Lease mode on a full disk, for real: the side effect ran, its result could not be stored.

Lease mode is for effects outside the database (an HTTP call), and promises
them at least once: the lease is committed before the call, the call's result
after it. Here the worker, the embedded broker and the SQLite store share a
small tmpfs (`tests.disk`) that fills *inside* a call, after its lease was
taken: the result is refused (SQLITE_FULL), so the message must stay unacked
and the call run again once its lease expired and space is back; the other
messages wait the outage out. Nothing may be dead-lettered or lost, only the
calls the outage cut may run twice, and every stored result must answer a
duplicate afterwards.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from sqlalchemy import text
from structlog.testing import capture_logs

from reliable.testing import test_app
from tests.disk import SpaceComesBack

ORDERS = 20
LEASE = 30.0  # seconds on the fake clock; space comes back after 60 of them (SpaceComesBack)


def test_a_lease_call_whose_result_a_full_disk_refused_runs_again_and_nothing_is_lost(small_disk: Path) -> None:
    clock = SpaceComesBack()
    app = test_app(small_disk, clock=clock, transport=f"embedded://{small_disk / 'broker'}",
                   settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "2"})
    calls: Counter[int] = Counter()  # the effect outside the database: what a mail server would count

    @app.handler("emails", token="body.id", lease=LEASE)
    def send(msg):
        calls[msg.body["id"]] += 1
        if msg.body["id"] == 5 and clock.ballast is None:
            clock.fill(small_disk)  # after the lease's commit, before the result's
        return {"sent": msg.body["id"]}

    try:
        for n in range(ORDERS):
            app.publish("emails", {"id": n})
        with capture_logs() as logs:
            app.run(until_idle=True)  # must not raise
        assert clock.ballast is not None and clock.ballast.hit_enospc, "the disk never filled"
        assert not clock.ballast.path.exists(), "space never came back"
        events = Counter(entry["event"] for entry in logs)
        refused = [e["token"] for e in logs if e["event"] == "lease_result_not_stored"]
        assert "5" in refused, events  # the dangerous moment happened: the call ran, its result was refused
        assert sorted(calls) == list(range(ORDERS))  # nothing lost
        assert calls[5] == 2  # run again once its lease expired: the at-least-once of lease mode
        assert [n for n, count in calls.items() if count > 1] == [5], calls  # no other call repeated
        assert app.dead_letters("send") == [] and app.stats()["dead_lettered"] == 0
        assert events["worker_stopped"] == 1
        with app.store.transaction() as tx:
            states = tx.execute(text("select state, count(*) from reliable_tokens group by state")).all()
        assert states == [("done", ORDERS)], states  # every result stored, no lease left in progress

        for n in range(ORDERS):  # duplicates after the outage get the stored results, no new call
            app.publish("emails", {"id": n})
        app.run(until_idle=True)
        assert sum(calls.values()) == ORDERS + 1
        assert app.stats()["duplicate"] == ORDERS
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()
