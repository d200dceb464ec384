"""Damage to the key index's files, stray files among the derived files, new files' directory fsyncs.

The commit log is the truth (`test_recovery.py` damages it); index files and
consume queues (`test_queue_damage.py`) only point into it. A damaged index
must never make a lookup return a wrong record, what does not add up is rebuilt
from the log, and every new segment or index file must be made durable in its
directory (fsynced after it was created). Each damage is done on a fresh copy
of one small store (`damagetools`).
"""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest
from damagetools import COUNT, QUEUES, Built, build, flip, fresh_copy, grow, read_queue
from storetools import record_for, small_config
from structlog.testing import capture_logs

from broker.errors import CorruptStoreError
from broker.store import MessageStore
from broker.store.indexfile import HEADER


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("damage") / "base")


def index_body_range(path: Path) -> tuple[int, int]:
    """The slot table and entries of an index file (everything after its header)."""
    return HEADER.size, path.stat().st_size


def test_index_bit_flips_never_return_a_wrong_record(
    built: Built, tmp_path: Path
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
    built: Built, tmp_path: Path
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
    built: Built, tmp_path: Path
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
    built: Built, tmp_path: Path, damage: str, victim_at: int
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


def test_stray_files_in_queue_and_index_folders_are_named_and_left_alone(
    built: Built, tmp_path: Path
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
