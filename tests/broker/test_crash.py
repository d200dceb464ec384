"""Kill -9 a `sync` writer 50 times at random moments: every acked record survives, byte for byte."""

from __future__ import annotations

import os
import random
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
from crash_writer import write
from storetools import body_for, read_all

from broker.store import MessageStore, StoreConfig
from tests import forked

KILLS = 50


def acked_ids(ack_file: Path) -> set[str]:
    lines = ack_file.read_bytes().split(b"\n")[:-1]  # a last line without "\n" is not an ack
    return {i for line in lines for i in line.decode().split()}


def drop_torn_line(ack_file: Path) -> None:
    """Cut an ack line the kill tore: SIGKILL can end a write between the pages it spans (the
    kernel checks for a fatal signal per page), and the next run's line would then be appended to
    the torn one ("40-3-146" + "41-0-0", an id no writer ever acked)."""
    data = ack_file.read_bytes()
    if (whole := data.rfind(b"\n") + 1) < len(data):
        os.truncate(ack_file, whole)


def wait_for_acks(ack_file: Path, previous: int, proc: BaseProcess) -> None:
    deadline = time.monotonic() + 60
    while ack_file.stat().st_size <= previous:
        assert proc.is_alive(), f"writer exited early with {proc.exitcode}"
        assert time.monotonic() < deadline, "writer acked nothing within 60 s"
        time.sleep(0.005)


def check(directory: Path, acked: set[str], fresh: set[str], run: int) -> None:
    """Reopen (crash recovery) and compare; a full read every tenth run and at the end."""
    store = MessageStore(directory, StoreConfig(flush="sync", segment_size=64 * 1024,
                                                max_record_size=8 * 1024, checkpoint_interval=0))
    try:
        for message_id in fresh:
            found = store.lookup_id(message_id)
            assert found is not None, f"acknowledged record {message_id} lost after kill {run}"
            assert found.body == body_for(message_id), message_id
        if run % 10 == 9:
            check_everything(store, acked, run)
        store.append([])  # still appendable
    finally:
        store._shutdown(clean=run % 2 == 0)  # odd runs leave the crash marker for the writer


def check_everything(store: MessageStore, acked: set[str], run: int) -> None:
    messages = read_all(store)
    stored = {m.message_id: m for m in messages}
    assert len(stored) == len(messages), "a record is stored twice"
    missing = acked - stored.keys()
    assert not missing, f"acknowledged records lost after kill {run}: {sorted(missing)[:5]}"
    for message in messages:
        written_in = int(message.message_id.split("-")[0])
        assert written_in <= run, f"invented record {message.message_id}"
        assert message.body == body_for(message.message_id), message.message_id
        assert message.headers == {"id": message.message_id}
    for topic, queue in store.queues():
        offsets = [m.queue_offset for m in messages if (m.topic, m.queue) == (topic, queue)]
        assert offsets == list(range(len(offsets))), f"gap in {topic}/{queue}"


@pytest.mark.parametrize("kills", [KILLS, pytest.param(500, marks=pytest.mark.soak)])
def test_kill_minus_nine_never_loses_an_acknowledged_record(tmp_path: Path, kills: int) -> None:
    directory, ack_file = tmp_path / "store", tmp_path / "acks"
    ack_file.touch()
    rng = random.Random(20261121)
    acked: set[str] = set()
    for run in range(kills):
        previous = ack_file.stat().st_size
        # forked from a process that imported the writer's modules already (`tests.forked`): a start
        # costs a fork, not 0.35 CPU-seconds of interpreter and imports, fifty times
        proc = forked.start(write, (str(directory), str(ack_file), run, 4), os.environ, tmp_path)
        try:
            wait_for_acks(ack_file, previous, proc)
            time.sleep(rng.uniform(0, 0.1))
        finally:
            proc.kill()  # SIGKILL
            proc.join()
        drop_torn_line(ack_file)
        fresh = acked_ids(ack_file) - acked
        acked |= fresh
        check(directory, acked, fresh, run)
    assert len(acked) > kills
