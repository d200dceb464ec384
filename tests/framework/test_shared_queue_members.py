"""Two members of a group on a leasing transport keep a bounded watermark, however long they run.

A leasing transport (memory, Redis Streams) gives every member every queue: the offsets the
other member takes are gaps this one never sees done, so its position stays below them and
every message it finished above them was a run of its own in its watermark, kept for as long
as it ran (a worker consuming for weeks beside another held millions). The runs kept are now
joined where they touch and bounded (`backends.watermark.MAX_DONE_RUNS`, set low here so a few
hundred messages pass it): the memory allocated in the watermark stops growing once it is
reached. Measured by tracemalloc after each round of 300 messages, with the bound at 16: 6.5 KB
each round (within 256 bytes); before, 17, 31, 31, 65, 75 and 84 KB (159 KB after 8 rounds).
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from backends import watermark
from reliable.commit import PerMessage
from reliable.testing import test_app
from reliable.worker import Worker

ROUNDS, PER_ROUND, BOUND = 6, 300, 16


def watermark_bytes() -> int:
    """Bytes allocated in the watermark's module and still held."""
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, watermark.__file__)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_two_members_taking_turns_keep_a_bounded_watermark(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watermark, "MAX_DONE_RUNS", BOUND, raising=False)
    app = test_app(tmp_path, settings={"RELIABLE_WORKER__PREFETCH": "3"})

    @app.handler("orders", group="billing", token="key")
    def bill(msg, tx) -> None:  # type: ignore[no-untyped-def]
        pass

    bill.config = app.config_for(bill)
    members = [Worker(bill, app.runtime, PerMessage()) for _ in range(2)]
    assert all(member.watermark is not None for member in members)  # the transport keeps no offsets
    held, taken = [], [0, 0]
    tracemalloc.start()
    try:
        for round_number in range(ROUNDS):
            for n in range(PER_ROUND):
                app.publish("orders", {"n": n}, key=f"k{round_number}-{n}")
            fetched = [member.poll(0) for member in members]
            while any(fetched):  # the members take turns: each fetch leaves gaps for the other
                taken = [total + count for total, count in zip(taken, fetched)]
                fetched = [member.poll(0) for member in members]
            held.append(watermark_bytes())
        assert members[0].pending() == 0
    finally:
        tracemalloc.stop()
        for member in members:
            member.close()
        app.close()
    assert sum(taken) == ROUNDS * PER_ROUND and min(taken) >= ROUNDS * PER_ROUND // 3, taken
    assert max(held[1:]) <= held[0] + 2048, f"watermark bytes after each round of {PER_ROUND}: {held}"
