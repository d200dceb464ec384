"""Recovery: torn tails, junk, bit flips, lost consume queues and index files."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from storetools import read_all, record_for, segments, small_config

from broker.errors import CorruptRecordError, CorruptStoreError
from broker.store import AppendResult, MessageStore
from broker.store.checkpoint import CHECKPOINT, MARKER


def build(path: Path, count: int = 60) -> list[AppendResult]:
    with MessageStore(path, small_config()) as store:
        return store.append([record_for(f"m{i}", "orders", i % 3) for i in range(count)])


def stored_ids(store: MessageStore) -> list[str]:
    return [m.message_id for m in sorted(read_all(store), key=lambda m: m.log_offset)]


def fresh_copy(base: Path, work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    return work


def test_truncated_tail_recovers_the_longest_valid_prefix(tmp_path: Path) -> None:
    placed = build(tmp_path / "base")
    last = segments(tmp_path / "base")[-1]
    base_offset, size = int(last.stem), last.stat().st_size
    rng = random.Random(7)
    for attempt in range(300):
        work = fresh_copy(tmp_path / "base", tmp_path / "work")
        cut = rng.randrange(0, size)
        with open(work / "commitlog" / last.name, "r+b") as segment:
            segment.truncate(cut)
        if attempt % 2:
            (work / MARKER).touch()
        expected = [p.message_id for p in placed if p.log_offset + p.size <= base_offset + cut]
        with MessageStore(work, small_config()) as store:
            assert stored_ids(store) == expected, f"cut at {cut}"
            [new] = store.append([record_for(f"new{attempt}", "orders", 1)])
            assert store.read("orders", 1, new.queue_offset, 1)[0].message_id == f"new{attempt}"
        if attempt % 30 == 0:
            with MessageStore(work, small_config()) as store:
                assert stored_ids(store) == [*expected, f"new{attempt}"]


@pytest.mark.parametrize("crashed", [False, True])
def test_junk_or_zeros_after_the_tail_are_cut_off(tmp_path: Path, crashed: bool) -> None:
    placed = build(tmp_path / "base")
    last = segments(tmp_path / "base")[-1]
    rng = random.Random(11)
    for attempt in range(150):
        work = fresh_copy(tmp_path / "base", tmp_path / "work")
        length = rng.randint(1, 1024)
        junk = bytes(length) if attempt % 5 == 0 else rng.randbytes(length)
        with open(work / "commitlog" / last.name, "ab") as segment:
            segment.write(junk)
        if crashed:
            (work / MARKER).touch()
        with MessageStore(work, small_config()) as store:
            assert stored_ids(store) == [p.message_id for p in placed]
            assert store.recovery.truncated_at == placed[-1].log_offset + placed[-1].size
            store.append([record_for("after-junk")])
        with MessageStore(work, small_config()) as store:
            assert stored_ids(store)[-1] == "after-junk"


def flip(path: Path, position: int, bit: int) -> None:
    with open(path, "r+b") as segment:
        segment.seek(position)
        byte = segment.read(1)[0]
        segment.seek(position)
        segment.write(bytes([byte ^ (1 << bit)]))


def test_single_bit_flips_never_return_a_wrong_body(tmp_path: Path) -> None:
    placed = build(tmp_path / "strict", count=40)
    shutil.copytree(tmp_path / "strict", tmp_path / "skip")
    files = segments(tmp_path / "strict")
    bases = [int(f.stem) for f in files]
    rng = random.Random(3)
    strict = MessageStore(tmp_path / "strict", small_config())
    lenient = MessageStore(tmp_path / "skip", small_config(skip_corrupt=True))
    all_ids = [p.message_id for p in placed]
    for _ in range(1000):
        victim = rng.choice(placed[:-1])  # mid-log: never the very last record
        index = max(i for i, base in enumerate(bases) if base <= victim.log_offset)
        position = victim.log_offset - bases[index] + rng.randrange(victim.size)
        bit = rng.randrange(8)
        name = files[index].name
        for directory in ("strict", "skip"):
            flip(tmp_path / directory / "commitlog" / name, position, bit)
        with pytest.raises(CorruptRecordError) as raised:
            read_all(strict)
        assert raised.value.path.endswith(name)
        assert raised.value.position == victim.log_offset - bases[index]
        found = strict.lookup_id(victim.message_id)
        assert found is None or found.body == record_for(victim.message_id).body
        survivors = read_all(lenient)
        assert [m.message_id for m in survivors] == [i for i in sorted(
            all_ids, key=lambda i: (int(i[1:]) % 3, int(i[1:]))) if i != victim.message_id]
        assert all(m.body == record_for(m.message_id).body for m in survivors)
        for directory in ("strict", "skip"):
            flip(tmp_path / directory / "commitlog" / name, position, bit)
    strict.close()
    lenient.close()


def test_mid_log_damage_found_by_recovery_names_file_and_offset(tmp_path: Path) -> None:
    placed = build(tmp_path / "base", count=40)
    files = segments(tmp_path / "base")
    victim = next(p for p in placed if p.log_offset > int(files[0].stem) + 100)
    index = max(i for i, f in enumerate(files) if int(f.stem) <= victim.log_offset)
    position = victim.log_offset - int(files[index].stem)
    rng = random.Random(5)
    for _ in range(30):
        work = fresh_copy(tmp_path / "base", tmp_path / "work")
        flip(work / "commitlog" / files[index].name, position + rng.randrange(victim.size),
             rng.randrange(8))
        (work / CHECKPOINT).unlink()
        (work / MARKER).touch()
        with pytest.raises(CorruptRecordError) as raised:
            MessageStore(work, small_config())
        assert raised.value.path.endswith(files[index].name)
        assert raised.value.position == position
        with MessageStore(work, small_config(skip_corrupt=True)) as store:
            assert victim.message_id not in stored_ids(store)
            assert len(stored_ids(store)) == 39
            assert store.recovery.skipped


def test_lost_consume_queues_and_index_are_rebuilt(tmp_path: Path) -> None:
    placed = build(tmp_path / "s")
    shutil.rmtree(tmp_path / "s" / "consumequeue")
    shutil.rmtree(tmp_path / "s" / "index")
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert sorted(stored_ids(store)) == sorted(p.message_id for p in placed)
        assert store.lookup_key("orders", "key-m7", 0, 2e9)[0].message_id == "m7"
        assert store.lookup_id("m59") is not None


def test_a_queue_behind_its_checkpoint_is_rebuilt(tmp_path: Path) -> None:
    build(tmp_path / "s")
    queue_dir = tmp_path / "s" / "consumequeue" / "orders" / "1"
    for cq in queue_dir.iterdir():
        cq.write_bytes(bytes(cq.stat().st_size))
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert store.max_offset("orders", 1) == 20
        assert [m.queue_offset for m in store.read("orders", 1, 0, 100)] == list(range(20))


def test_crash_without_checkpoint_replays_everything(tmp_path: Path) -> None:
    placed = build(tmp_path / "s")
    (tmp_path / "s" / CHECKPOINT).unlink()
    (tmp_path / "s" / MARKER).touch()
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert store.recovery.crashed and store.recovery.records_replayed == len(placed)
        assert len(stored_ids(store)) == len(placed)
        assert store.lookup_id("m0") is not None


def test_missing_middle_segment_is_a_hard_error(tmp_path: Path) -> None:
    build(tmp_path / "s")
    middle = segments(tmp_path / "s")[1]
    middle.unlink()
    with pytest.raises(CorruptStoreError, match="ends at log offset"):
        MessageStore(tmp_path / "s", small_config())


@pytest.mark.parametrize("name", ["notes.log", "16.log", "00000000000000000000-copy.log"])
def test_a_misnamed_segment_is_a_hard_error_naming_it(tmp_path: Path, name: str) -> None:
    """A segment is not derived from anything: a file in the log's folder that is not named as
    the store names segments stops the open, named, and nothing stored changes."""
    build(tmp_path / "s")
    stray = tmp_path / "s" / "commitlog" / name
    stray.write_bytes(b"an operator's file")
    before = {path: path.read_bytes() for path in sorted((tmp_path / "s").rglob("*")) if path.is_file()}
    with pytest.raises(CorruptStoreError, match=rf"{name}: not a commit-log segment name \(expected 20 digits"):
        MessageStore(tmp_path / "s", small_config())
    after = {path: path.read_bytes() for path in sorted((tmp_path / "s").rglob("*")) if path.is_file()}
    assert after == before
    stray.unlink()
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert len(stored_ids(store)) == 60


def test_unreadable_checkpoint_is_a_hard_error(tmp_path: Path) -> None:
    build(tmp_path / "s")
    (tmp_path / "s" / CHECKPOINT).write_text("{not json")
    with pytest.raises(CorruptStoreError, match="checkpoint"):
        MessageStore(tmp_path / "s", small_config())


def test_files_torn_at_birth_by_a_kill_are_recreated(tmp_path: Path) -> None:
    placed = build(tmp_path / "s")
    (tmp_path / "s" / "index" / f"{placed[-1].log_offset:020d}.idx").touch()
    (tmp_path / "s" / "index" / f"{placed[-1].log_offset + 1:020d}.idx").write_bytes(bytes(4096))
    (tmp_path / "s" / "consumequeue" / "orders" / "9").mkdir()
    (tmp_path / "s" / "consumequeue" / "orders" / "9" / f"{0:020d}.cq").touch()
    (tmp_path / "s" / MARKER).write_text("another boot")
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert len(stored_ids(store)) == len(placed)
        assert store.lookup_key("orders", "key-m59", 0, 2e9)[0].message_id == "m59"
        store.append([record_for("nine", "orders", 9)])
        assert store.read("orders", 9, 0, 5)[0].message_id == "nine"
