"""Damage to the derived files: consume queues and the key index, and new files' directory fsyncs.

The commit log is the truth (`test_recovery.py` damages it); consume queues
and index files only point into it. Damaged pointers must never yield a
wrong message, a damaged tail must be rebuilt from the log, and every new
segment or index file must be made durable in its directory (fsynced after
it was created). Each damage is done on a fresh copy of one small store.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from storetools import read_all, record_for, small_config
from structlog.testing import capture_logs

from broker.errors import CorruptRecordError, CorruptStoreError
from broker.store import AppendResult, FakeClock, MessageStore, Record
from broker.store.checkpoint import MARKER
from broker.store.indexfile import HEADER

COUNT = 120
QUEUES = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[AppendResult]]:
    """A store of 120 records over three queues: several segments, queue files and index files."""
    path = tmp_path_factory.mktemp("damage") / "base"
    with MessageStore(path, small_config()) as store:
        placed = store.append([record_for(f"m{i}", "orders", i % QUEUES) for i in range(COUNT)])
    return path, placed


def fresh_copy(base: Path, work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    return work


def flip(path: Path, position: int, bit: int) -> None:
    with open(path, "r+b") as damaged:
        damaged.seek(position)
        byte = damaged.read(1)[0]
        damaged.seek(position)
        damaged.write(bytes([byte ^ (1 << bit)]))


def read_queue(store: MessageStore, queue: int) -> Iterator[object]:
    """Every message of orders/<queue> the store returns, in small reads."""
    offset = 0
    while batch := store.read("orders", queue, offset, 7):
        yield from batch
        offset = batch[-1].queue_offset + 1


def assert_queue_whole(store: MessageStore, placed: list[AppendResult], queue: int) -> None:
    """orders/<queue> holds every message placed there, unchanged, and takes the next one after them."""
    assert [(m.message_id, m.body) for m in read_queue(store, queue)] == [  # type: ignore[attr-defined]
        (p.message_id, record_for(p.message_id).body) for p in placed if p.queue == queue]
    assert store.max_offset("orders", queue) == sum(1 for p in placed if p.queue == queue)
    [added] = store.append([record_for("new", "orders", queue)])
    assert store.read("orders", queue, added.queue_offset - 1, 2)[-1].message_id == "new"


@pytest.mark.parametrize("skip_corrupt", [False, True])
def test_consume_queue_bit_flips_never_return_a_wrong_message(
    built: tuple[Path, list[AppendResult]], tmp_path: Path, skip_corrupt: bool
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
    built: tuple[Path, list[AppendResult]], tmp_path: Path, crashed: bool
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


def index_body_range(path: Path) -> tuple[int, int]:
    """The slot table and entries of an index file (everything after its header)."""
    return HEADER.size, path.stat().st_size


def test_index_bit_flips_never_return_a_wrong_record(
    built: tuple[Path, list[AppendResult]], tmp_path: Path
) -> None:
    base, placed = built
    index_files = sorted(p.relative_to(base) for p in (base / "index").glob("*.idx"))
    assert len(index_files) >= 3
    rng = random.Random(18)
    missed = 0
    for _ in range(150):
        work = fresh_copy(base, tmp_path / "work")
        victim = work / rng.choice(index_files)
        start, end = index_body_range(victim)
        flip(victim, rng.randrange(start, end), rng.randrange(8))
        with MessageStore(work, small_config()) as store:
            for placed_record in rng.sample(placed, 12):
                name = placed_record.message_id
                by_key = store.lookup_key("orders", f"key-{name}", 0, 2e9)
                assert [m.message_id for m in by_key] in ([name], [])  # a damaged chain may miss, never lie
                by_id = store.lookup_id(name)
                assert by_id is None or (by_id.message_id == name and by_id.body == record_for(name).body)
                missed += not by_key
    assert missed, "some flips broke a chain (the lookups above really met damage)"


def test_an_index_file_cut_short_is_rebuilt_or_named(
    built: tuple[Path, list[AppendResult]], tmp_path: Path
) -> None:
    base, _ = built
    work = fresh_copy(base, tmp_path / "work")
    victim = sorted((work / "index").glob("*.idx"))[0]
    os.truncate(victim, victim.stat().st_size // 2)
    try:
        with MessageStore(work, small_config()) as store:
            assert [m.message_id for m in store.lookup_key("orders", "key-m7", 0, 2e9)] == ["m7"]
    except CorruptStoreError as exc:
        assert victim.name in str(exc)
    except Exception as exc:  # what it does today
        raise AssertionError(f"opening failed with {exc!r}, naming no file") from exc


def test_index_header_bit_flips_never_return_a_wrong_record_nor_fail_the_open(
    built: tuple[Path, list[AppendResult]], tmp_path: Path
) -> None:
    """A flip in a header field the open checks (sizes, log offsets, sealed) rebuilds the file;
    one in its time bounds or count may hide entries; no flip makes a lookup lie or the open fail."""
    base, placed = built
    index_files = sorted(p.relative_to(base) for p in (base / "index").glob("*.idx"))
    rng = random.Random(19)
    for _ in range(60):
        work = fresh_copy(base, tmp_path / "work")
        flip(work / rng.choice(index_files), rng.randrange(HEADER.size), rng.randrange(8))
        with MessageStore(work, small_config()) as store:
            for placed_record in rng.sample(placed, 12):
                name = placed_record.message_id
                by_key = store.lookup_key("orders", f"key-{name}", 0, 2e9)
                assert [m.message_id for m in by_key] in ([name], [])
                by_id = store.lookup_id(name)
                assert by_id is None or (by_id.message_id == name and by_id.body == record_for(name).body)


def zero_header(path: Path) -> None:
    with open(path, "r+b") as damaged:
        damaged.write(bytes(HEADER.size))


def grow(path: Path) -> None:
    with open(path, "ab") as damaged:
        damaged.write(b"junk")


INDEX_DAMAGE = {
    "cut short": lambda path: os.truncate(path, path.stat().st_size // 3),
    "emptied": lambda path: os.truncate(path, 0),
    "zeroed header": zero_header,
    "grown": grow,
    "lost": Path.unlink,
}


@pytest.mark.parametrize(("damage", "victim_at"), [
    (damage, victim_at) for damage in INDEX_DAMAGE for victim_at in (0, 1, -1)
])
def test_a_damaged_index_file_is_rebuilt_from_the_log(
    built: tuple[Path, list[AppendResult]], tmp_path: Path, damage: str, victim_at: int
) -> None:
    """A sealed or open index file damaged, or a file lost: logged, rebuilt, every key and id found again."""
    base, placed = built
    work = fresh_copy(base, tmp_path / "work")
    victim = sorted((work / "index").glob("*.idx"))[victim_at]
    INDEX_DAMAGE[damage](victim)
    with capture_logs() as logs, MessageStore(work, small_config()) as store:
        for placed_record in placed:
            name = placed_record.message_id
            assert [m.message_id for m in store.lookup_key("orders", f"key-{name}", 0, 2e9)] == [name]
            found = store.lookup_id(name)
            assert found is not None and found.body == record_for(name).body
    rebuilt = [entry for entry in logs if entry["event"] == "store.index_rebuilt"]
    if damage != "lost":
        assert [(entry["file"], victim.name in entry["dropped"]) for entry in rebuilt] == [(str(victim), True)]
        assert rebuilt[0]["reason"]
    elif victim_at == 0:  # the log holds keys from its first record on: the first file is missing
        assert len(rebuilt) == 1 and "before the first index file" in rebuilt[0]["reason"], rebuilt
    elif victim_at != -1:  # the file before the lost one no longer chains to the next
        assert len(rebuilt) == 1 and f"ends at log offset {int(victim.stem)}," in rebuilt[0]["reason"]


def test_a_hole_in_a_consume_queue_is_rebuilt(built: tuple[Path, list[AppendResult]], tmp_path: Path) -> None:
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
    built: tuple[Path, list[AppendResult]], tmp_path: Path, damage: str, victim_at: int, crashed: bool
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
    built: tuple[Path, list[AppendResult]], tmp_path: Path, zeroed: str, crashed: bool
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


def test_stray_files_in_queue_and_index_folders_are_named_and_left_alone(
    built: tuple[Path, list[AppendResult]], tmp_path: Path
) -> None:
    """A file with a store file's suffix but not a store file's name (20 digits) is never read as
    one, never deleted, and named in a warning; the store opens and serves every message."""
    base, placed = built
    work = fresh_copy(base, tmp_path / "work")
    strays = [work / "consumequeue" / "orders" / "1" / "notes.cq", work / "consumequeue" / "orders" / "1" / "16.cq",
              work / "index" / "x.idx", work / "index" / "backup-00000000000000000000.idx"]
    for stray in strays:
        stray.write_bytes(b"an operator's file")
    with capture_logs() as logs, MessageStore(work, small_config()) as store:
        assert [m.message_id for m in read_queue(store, 1)] == [  # type: ignore[attr-defined]
            p.message_id for p in placed if p.queue == 1]
        for placed_record in placed:
            name = placed_record.message_id
            assert [m.message_id for m in store.lookup_key("orders", f"key-{name}", 0, 2e9)] == [name]
    assert all(stray.read_bytes() == b"an operator's file" for stray in strays)
    ignored = [entry for entry in logs if entry["event"] == "store.stray_file_ignored"]
    assert sorted(entry["file"] for entry in ignored) == sorted(map(str, strays))
    assert all("20 digits" in entry["expected"] for entry in ignored)
    assert not [entry for entry in logs if entry["event"] in ("store.queue_rebuilt", "store.index_rebuilt")]


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
    built: tuple[Path, list[AppendResult]], tmp_path: Path
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


def test_new_segment_and_index_files_are_fsynced_in_their_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every directory fsync is recorded with the names the directory held at that moment: each
    segment and index file must have been there for one of them (created, then made durable)."""
    durable: dict[str, set[str]] = {}
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            durable.setdefault(path, set()).update(os.listdir(path))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = tmp_path / "store"
    with MessageStore(path, small_config()) as store:
        for start in range(0, COUNT, 10):  # appends that roll segments and index files as they go
            store.append([record_for(f"m{i}", "orders", i % QUEUES) for i in range(start, start + 10)])
        segments = sorted(p.name for p in (path / "commitlog").glob("*.log"))
        index_files = sorted(p.name for p in (path / "index").glob("*.idx"))
    assert len(segments) >= 5 and len(index_files) >= 3
    assert set(segments) <= durable.get(str(path / "commitlog"), set())
    assert set(index_files) <= durable.get(str(path / "index"), set())
