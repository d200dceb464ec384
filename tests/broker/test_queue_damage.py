"""Damage to the consume queues: bit flips, torn tails, holes, zeroed entries, lost files.

Consume queues only point into the commit log. Damaged pointers must never
yield a wrong message; a queue whose files do not add up (a tail torn, a file
lost, of the wrong size or misnamed, entries zeroed below its end, its first
file lost) is cut, logged (`store.queue_rebuilt`) and rebuilt from the log,
while what retention removed is not taken for lost. Each damage is done on a
fresh copy of one small store (`damagetools`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from damagetools import QUEUES, Built, assert_queue_whole, build, flip, fresh_copy, grow, read_queue
from storetools import read_all, record_for, small_config
from structlog.testing import capture_logs

from broker.errors import CorruptRecordError
from broker.store import FakeClock, MessageStore, Record
from broker.store.checkpoint import MARKER


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("damage") / "base")


@pytest.mark.parametrize("skip_corrupt", [False, True])
def test_consume_queue_bit_flips_never_return_a_wrong_message(
    built: Built, tmp_path: Path, skip_corrupt: bool
) -> None:
    base, placed = built
    placed_at = {(p.queue, p.queue_offset): p.message_id for p in placed}
    queue_files = sorted(p.relative_to(base) for p in (base / "consumequeue").rglob("*.cq"))
    rng = random.Random(16)
    refused = 0
    for _ in range(150):
        work = fresh_copy(base, tmp_path / "work")
        victim = work / rng.choice(queue_files)
        flip(victim, rng.randrange(victim.stat().st_size), rng.randrange(8))
        with MessageStore(work, small_config(skip_corrupt=skip_corrupt)) as store:
            for queue in range(QUEUES):
                try:
                    for message in read_queue(store, queue):
                        assert placed_at[(queue, message.queue_offset)] == message.message_id  # type: ignore[attr-defined]
                        assert message.body == record_for(message.message_id).body  # type: ignore[attr-defined]
                except CorruptRecordError:
                    assert not skip_corrupt, "a store that skips corrupt records never raises on a read"
                    refused += 1
    assert skip_corrupt or refused, "some flips landed on an entry's log offset or size and were refused"


@pytest.mark.parametrize("crashed", [False, True])
def test_consume_queue_tail_damage_is_rebuilt_from_the_log(
    built: Built, tmp_path: Path, crashed: bool
) -> None:
    """The last queue file cut short, with junk after its last entry, or with its tail zeroed
    (mapped pages a machine crash never wrote): recovery rebuilds it from the commit log."""
    base, placed = built
    every_id = sorted(p.message_id for p in placed)
    lengths = {q: sum(1 for p in placed if p.queue == q) for q in range(QUEUES)}
    rng = random.Random(17)
    for attempt in range(45):
        work = fresh_copy(base, tmp_path / "work")
        queue = rng.randrange(QUEUES)
        last = sorted((work / "consumequeue" / "orders" / str(queue)).glob("*.cq"))[-1]
        data = bytearray(last.read_bytes())
        used = 16 * sum(1 for at in range(0, len(data), 16) if any(data[at : at + 16]))
        damage = attempt % 3
        if damage == 0:
            del data[rng.randrange(len(data)) :]
        elif damage == 1 and used < len(data):
            junk = rng.randint(1, len(data) - used)
            data[used : used + junk] = rng.randbytes(junk)
        else:
            cut = rng.randrange(len(data))
            data[cut:] = bytes(len(data) - cut)
        last.write_bytes(bytes(data))
        if crashed:
            (work / MARKER).write_text("another boot")
        with MessageStore(work, small_config()) as store:
            assert sorted(m.message_id for m in read_all(store)) == every_id, f"damage {damage}"
            assert {q: store.max_offset("orders", q) for q in range(QUEUES)} == lengths
            [added] = store.append([record_for(f"new{attempt}", "orders", queue)])
            assert added.queue_offset == lengths[queue]
            assert store.read("orders", queue, added.queue_offset, 1)[0].message_id == f"new{attempt}"


def test_a_hole_in_a_consume_queue_is_rebuilt(built: Built, tmp_path: Path) -> None:
    base, placed = built
    work = fresh_copy(base, tmp_path / "work")
    middle = sorted((work / "consumequeue" / "orders" / "1").glob("*.cq"))[1]
    middle.unlink()
    (work / MARKER).write_text("another boot")
    with MessageStore(work, small_config()) as store:
        assert [m.message_id for m in read_queue(store, 1)] == [  # type: ignore[attr-defined]
            p.message_id for p in placed if p.queue == 1]


QUEUE_DAMAGE = {
    "lost": Path.unlink,
    "cut short": lambda path: os.truncate(path, path.stat().st_size // 2 + 3),
    "emptied": lambda path: os.truncate(path, 0),
    "grown": grow,
    "renamed off its place": lambda path: path.rename(path.with_name(f"{int(path.stem) + 3:020d}.cq")),
}


@pytest.mark.parametrize("crashed", [False, True])
@pytest.mark.parametrize(("damage", "victim_at"), [
    (damage, victim_at) for damage in QUEUE_DAMAGE for victim_at in (0, 1)
])
def test_a_damaged_consume_queue_file_below_the_end_is_rebuilt(
    built: Built, tmp_path: Path, damage: str, victim_at: int, crashed: bool
) -> None:
    """The first or a middle queue file lost, of the wrong size or misnamed: the queue is cut there
    (a lost first file: the log still holds the queue offsets it held), logged, and rebuilt from the
    log; every message comes back unchanged and appends go on."""
    base, placed = built
    work = fresh_copy(base, tmp_path / "work")
    victim = sorted((work / "consumequeue" / "orders" / "1").glob("*.cq"))[victim_at]
    QUEUE_DAMAGE[damage](victim)
    if crashed:
        (work / MARKER).write_text("another boot")
    with capture_logs() as logs, MessageStore(work, small_config()) as store:
        assert store.recovery.rebuilt_queues == ["orders/1"]
        assert_queue_whole(store, placed, 1)
    [cut] = [entry for entry in logs if entry["event"] == "store.queue_rebuilt"]
    named = victim.with_name(f"{int(victim.stem) + 3:020d}.cq") if damage.startswith("renamed") else victim
    assert (cut["topic"], cut["queue"], cut["file"]) == ("orders", 1, str(named)), cut
    assert cut["reason"] and (named.name in cut["dropped"] or damage == "lost")


ZEROED = {  # queue offsets of orders/1 whose entries are zeroed: (queue files of 16 entries, 40 entries)
    "a middle file": range(19, 22),
    "the last file, one entry": range(33, 34),
    "the last file, a run": range(34, 37),
}


@pytest.mark.parametrize("crashed", [False, True])
@pytest.mark.parametrize("zeroed", ZEROED)
def test_zeroed_entries_below_the_end_of_a_consume_queue_are_rebuilt(
    built: Built, tmp_path: Path, zeroed: str, crashed: bool
) -> None:
    """Entries zeroed with entries after them (pages a machine crash never wrote, a disk's damage):
    the queue is cut at the first, logged, and rebuilt from the log; no read stops at the hole."""
    base, placed = built
    work = fresh_copy(base, tmp_path / "work")
    files = sorted((work / "consumequeue" / "orders" / "1").glob("*.cq"))
    victim = next(path for path in reversed(files) if int(path.stem) <= ZEROED[zeroed][0])
    with open(victim, "r+b") as damaged:
        damaged.seek((ZEROED[zeroed][0] - int(victim.stem)) * 16)
        damaged.write(bytes(16 * len(ZEROED[zeroed])))
        os.fsync(damaged.fileno())
    if crashed:
        (work / MARKER).write_text("another boot")
    with capture_logs() as logs, MessageStore(work, small_config()) as store:
        assert_queue_whole(store, placed, 1)
    [cut] = [entry for entry in logs if entry["event"] == "store.queue_rebuilt"]
    assert (cut["topic"], cut["queue"], cut["file"]) == ("orders", 1, str(victim)), cut
    assert f"entry {ZEROED[zeroed][0]} is empty" in cut["reason"]


def test_first_files_retention_removed_or_never_made_are_not_taken_for_lost(tmp_path: Path) -> None:
    """What retention removed (queue and index files below the log) and an index whose first file
    begins after records with no key and a store-made id: reopened, nothing is rebuilt."""
    clock = FakeClock()
    config = small_config(clock=clock, retention=60, queue_file_entries=4, index_entries=8)
    path = tmp_path / "store"
    with MessageStore(path, config) as store:
        store.append([Record("orders", i % 2, b"no key, no id") for i in range(30)])
        store.append([record_for(f"old{i}", "orders", i % 2) for i in range(50)])
        clock.advance(120)
        store.append([record_for(f"new{i}", "orders", i % 2) for i in range(10)])
    with capture_logs() as reopened, MessageStore(path, config) as store:
        assert int(sorted((path / "index").glob("*.idx"))[0].stem) > 0  # begins at the first key
        store.clean()  # retention: segments, then queue and index files below the log
    assert min(int(p.stem) for p in (path / "consumequeue" / "orders" / "0").glob("*.cq")) > 0
    with capture_logs() as cleaned, MessageStore(path, config) as store:
        assert store.recovery.rebuilt_queues == []
        assert {f"new{i}" for i in range(10)} <= {m.message_id for m in read_all(store)}
    rebuilt = [e for e in reopened + cleaned if e["event"] in ("store.queue_rebuilt", "store.index_rebuilt")]
    assert not rebuilt


def test_a_hole_after_the_checkpoint_is_refilled_by_the_replay(
    built: Built, tmp_path: Path
) -> None:
    """A lost queue file whose entries all came after the last checkpoint (a machine crash): the
    queue is not behind the checkpoint, yet the replay from it refills the hole."""
    base, placed = built
    work = fresh_copy(base, tmp_path / "work")
    old_checkpoint = (work / "checkpoint.json").read_bytes()
    with MessageStore(work, small_config()) as store:
        placed = placed + store.append([record_for(f"late{i}", "orders", 1) for i in range(40)])
    (work / "checkpoint.json").write_bytes(old_checkpoint)
    (work / MARKER).write_text("another boot")
    queue_files = sorted((work / "consumequeue" / "orders" / "1").glob("*.cq"))
    assert int(queue_files[-2].stem) >= sum(1 for p in built[1] if p.queue == 1)
    queue_files[-2].unlink()
    with MessageStore(work, small_config()) as store:
        assert [m.message_id for m in read_queue(store, 1)] == [  # type: ignore[attr-defined]
            p.message_id for p in placed if p.queue == 1]
        assert store.recovery.rebuilt_queues == []
