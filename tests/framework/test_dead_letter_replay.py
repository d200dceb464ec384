"""Dead-letter replay under the hands of several operators and a hostile transport.

Replays run in processes of their own against a real PostgreSQL store and the
broker server (``reliable://``), and meet where it hurts: a middleware hook
makes each one wait, inside its replay, for the other side to be under way
too, so the race happens on every run. Deliveries are counted by a handler
without a token (each delivery is processed), or with the default token (the
message id) to show a copy sent again is a duplicate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from backends.clock import FakeClock
from backends.store.sqlalchemy import SqlStore
from backends.types import DeadLetter, Failure, Message
from reliable import App
from reliable.deadletter import CHUNK, HOLD, DeadLetters
from reliable.errors import DeadLetterNotFoundError, ReplayLoopError, ReplayRefusedError
from reliable.settings import Settings

REPO = Path(__file__).resolve().parents[2]

REPLAYER = """
import os, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import reliable
from reliable.settings import Settings
from tests.waiting import wait_until

store, transport, group, here, there, kill_after, meet_at = sys.argv[1:8]

class Meet(reliable.Middleware):
    '''Before send number ``meet_at``, say so (``here``) and wait for ``there``; SIGKILL itself
    once sends took ``kill_after`` letters or more (0: never), before the replay records them.'''
    sends = letters = 0
    def before_publish(self, publish):
        if publish.replay and self.sends == int(meet_at) - 1:
            Path(here).touch()
            wait_until(lambda: Path(there).exists(), "the other side of the race")
    def after_publish(self, publish, error):
        if publish.replay:
            self.sends += 1
            self.letters += publish.count
            if int(kill_after) and self.letters >= int(kill_after):
                os.kill(os.getpid(), 9)

app = reliable.App(Settings.load(None, env={{"RELIABLE_STORE__URL": store, "RELIABLE_TRANSPORT__URL": transport,
                                             "RELIABLE_LOG__LEVEL": "warning"}}), middleware=[Meet()])
print(app.replay_dead_letters(group), flush=True)
app.close()
"""


def seed(store_url: str, group: str, count: int, topic: str | None = None, size: int = 10,
         first: int = 0) -> list[int]:
    """``count`` dead letters of ``group`` from ``topic`` (by default the topic named as the group:
    no other test's messages on a shared server), numbered from ``first``, each with a token and
    a message id of its own."""
    store, now = SqlStore(store_url), time.time()
    with store.transaction() as tx:
        ids = [tx.add_dead_letter(DeadLetter(
            group=group, token=f"{group}-{i}",
            message=Message(id=f"{group}-m{i}", topic=topic or group, queue=0, offset=i, published_at=now,
                            payload=json.dumps({"id": f"{group}-{i}", "pad": "x" * size}).encode()),
            failure=Failure("builtins.ValueError", "amount must be positive", "Traceback", 1, now, now),
        )) for i in range(first, first + count)]
    store.close()
    return [letter_id for letter_id in ids if letter_id is not None]


def replayer(tmp_path: Path, store: str, transport: str, group: str, here: str, there: str,
             kill_after: int = 0, meet_at: int = 1) -> subprocess.Popen[str]:
    script = tmp_path / "replayer.py"
    script.write_text(REPLAYER.format(repo=str(REPO)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    return subprocess.Popen([sys.executable, str(script), store, transport, group, str(tmp_path / here),
                             str(tmp_path / there), str(kill_after), str(meet_at)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finished(process: subprocess.Popen[str]) -> str:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return out


def deliveries(store: str, transport: str, group: str, token: str | None = None) -> dict[str, int]:
    """Run ``group``'s handler until nothing is left; its counters."""
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": store, "RELIABLE_TRANSPORT__URL": transport,
                                       "RELIABLE_LOG__LEVEL": "warning"}))
    app.handler(group, group=group, token=token)(lambda msg, tx: None)
    app.run(until_idle=True)
    stats = app.stats()
    app.close()
    return stats


@pytest.fixture
def broker_url(reliable_server) -> str:  # type: ignore[no-untyped-def]
    return str(reliable_server.url)


def test_two_replays_at_once_send_each_dead_letter_once(tmp_path, postgres_url, broker_url, unique) -> None:
    """Both replays used to read every letter first, then send them all: 3 chunks sent twice."""
    total = 3 * CHUNK
    seed(postgres_url, unique, total)
    first = replayer(tmp_path, postgres_url, broker_url, unique, "first", "second")
    second = replayer(tmp_path, postgres_url, broker_url, unique, "second", "first")
    counts = [int(finished(first)), int(finished(second))]
    assert (tmp_path / "first").exists() and (tmp_path / "second").exists()  # each sent while the other ran
    assert sum(counts) == total and min(counts) > 0, counts  # they shared the letters
    stats = deliveries(postgres_url, broker_url, unique)
    assert stats["processed"] == total
    assert SqlStore(postgres_url).count_dead_letters(unique) == 0


def test_letters_purged_while_a_replay_runs_are_not_replayed(tmp_path, postgres_url, broker_url, unique) -> None:
    """The replay used to send the letters it had listed before the purge deleted them."""
    ids = seed(postgres_url, unique, 3 * CHUNK)
    replay = replayer(tmp_path, postgres_url, broker_url, unique, "replaying", "purged")
    from tests.waiting import wait_until

    wait_until(lambda: (tmp_path / "replaying").exists(), "the replay to send its first chunk")
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": postgres_url, "RELIABLE_TRANSPORT__URL": broker_url}))
    assert app.purge_dead_letters(unique, ids[CHUNK:]) == 2 * CHUNK  # the chunks the replay has not reached
    app.close()
    (tmp_path / "purged").touch()
    assert int(finished(replay)) == CHUNK
    assert deliveries(postgres_url, broker_url, unique)["processed"] == CHUNK
    assert SqlStore(postgres_url).count_dead_letters(unique) == 0


@pytest.mark.parametrize("backends", ["postgresql+reliable", "sqlite+embedded"])
def test_a_replay_killed_mid_run_replays_every_letter_and_resends_only_the_send_it_cut(
    tmp_path, request, unique, backends
) -> None:
    """kill -9 once 150 of 300 letters went, after a send and before the replay recorded it: the
    letters of that send stay, held until the dead replay's hold runs out; the next replay sends
    the rest at once and those later, with the same message ids, so the consumer's default token
    (the message id) takes each letter once. The cut send was a whole chunk of 100 held in one
    transaction: 50 letters the transport had taken went again."""
    if backends == "sqlite+embedded":
        store_url, transport_url = f"sqlite:///{tmp_path / 'store.db'}", f"embedded://{tmp_path / 'broker'}"
    else:
        store_url, transport_url = request.getfixturevalue("postgres_url"), request.getfixturevalue("broker_url")
    total, kill_at = 300, 150
    seed(store_url, unique, total)
    (tmp_path / "go").touch()
    killed = replayer(tmp_path, store_url, transport_url, unique, "replaying", "go", kill_after=kill_at)
    killed.communicate(timeout=120)
    assert killed.returncode == -9
    cut = -(-kill_at // CHUNK) * CHUNK  # letters sent when the kill came
    store = SqlStore(store_url)
    assert store.count_dead_letters(unique) == total - cut + CHUNK  # the cut send's letters stayed
    again = replayer(tmp_path, store_url, transport_url, unique, "again", "go")
    assert int(finished(again)) == total - cut  # the cut send's letters are still held by the dead replay
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": store_url, "RELIABLE_TRANSPORT__URL": transport_url,
                                       "RELIABLE_LOG__LEVEL": "warning"}))
    one_hold_later = SqlStore(store_url, clock=FakeClock(time.time() + HOLD + 1))
    assert DeadLetters(one_hold_later, app.transport).replay(unique) == CHUNK
    app.close()
    stats = deliveries(store_url, transport_url, unique, token="id")
    assert (stats["processed"], stats["duplicate"]) == (total, CHUNK)  # every letter once; the cut send twice
    assert CHUNK <= 20  # was a chunk of 100
    assert store.count_dead_letters(unique) == 0


def test_a_replay_sends_with_no_store_transaction_open(tmp_path, unique) -> None:
    """On SQLite the replay held the store's write lock (the whole database's) while it sent a
    chunk: a handler's commit waited behind the transport, however slow it was."""
    from reliable import Middleware
    from tests.waiting import wait_until

    store = f"sqlite:///{tmp_path / 'store.db'}"
    seed(store, unique, 2 * CHUNK)
    committed: list[str] = []

    class CommitWhileSending(Middleware):
        def before_publish(self, publish) -> None:  # type: ignore[no-untyped-def]
            if publish.replay:
                writer = threading.Thread(target=lambda: commit(f"during send {len(committed) + 1}"))
                writer.start()
                wait_until(lambda: not writer.is_alive(), "a commit while the replay sends", timeout=10)

    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": store, "RELIABLE_TRANSPORT__URL":
                                       f"embedded://{tmp_path / 'broker'}", "RELIABLE_LOG__LEVEL": "warning"}),
              middleware=[CommitWhileSending()])

    def commit(what: str) -> None:
        with app.store.transaction() as tx:
            tx.execute(text("create table if not exists handled (what text)"))
            tx.execute(text("insert into handled values (:w)"), {"w": what})
        committed.append(what)

    assert app.replay_dead_letters(unique) == 2 * CHUNK
    assert committed == ["during send 1", "during send 2"]
    app.close()


def test_letters_a_worker_dead_letters_again_during_a_replay_wait_for_the_next_one(
    tmp_path, postgres_url, broker_url, unique
) -> None:
    """The replay's first chunk fails again in a running worker and is dead-lettered anew (new
    ids) before the replay sends its second: the replay sends each letter it chose once, and not
    the new records, which a paging replay would reach and send again."""
    total = 3 * CHUNK
    seed(postgres_url, unique, total)
    replay = replayer(tmp_path, postgres_url, broker_url, unique, "second chunk", "failed again", meet_at=2)
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": postgres_url, "RELIABLE_TRANSPORT__URL": broker_url,
                                       "RELIABLE_LOG__LEVEL": "warning"}))

    @app.handler(unique, group=unique, token="body.id", fatal=(ValueError,))
    def charge(msg, tx):  # type: ignore[no-untyped-def]
        raise ValueError("amount must be positive")

    from tests.waiting import wait_until

    wait_until(lambda: (tmp_path / "second chunk").exists(), "the replay to reach its second chunk")
    wait_until(lambda: app.run(until_idle=True) or len(app.store.dead_letter_ids(unique, min_replays=1)) == CHUNK,
               "the worker to dead-letter the first chunk again")
    (tmp_path / "failed again").touch()
    assert int(finished(replay)) == total
    app.run(until_idle=True)
    letters = app.store.dead_letter_ids(unique)
    assert len(letters) == total and app.store.dead_letter_ids(unique, min_replays=2) == []
    assert len(app.store.dead_letter_ids(unique, min_replays=1)) == total  # each replayed once
    app.close()


def embedded_app(tmp_path: Path) -> App:
    return App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                        "RELIABLE_TRANSPORT__URL": f"embedded://{tmp_path / 'broker'}",
                                        "RELIABLE_LOG__LEVEL": "warning"}))


def test_letters_the_transport_refuses_are_named_and_stay_while_the_rest_are_replayed(tmp_path, unique) -> None:
    """A letter from a topic the broker does not take and one too large for its records used to
    stop the replay with the broker's words only: the rest of its chunk and every later chunk
    stayed behind, and nothing said which letter was at fault."""
    store = f"sqlite:///{tmp_path / 'store.db'}"
    ids = seed(store, unique, 2 * CHUNK + 50)
    [bad_topic] = seed(store, unique, 1, topic="bad topic", first=1000)
    [too_large] = seed(store, unique, 1, size=5 * 1024 * 1024, first=1001)
    ids += seed(store, unique, 10, first=1002)
    app = embedded_app(tmp_path)
    with pytest.raises(ReplayRefusedError) as refused:
        app.replay_dead_letters(unique)
    assert set(refused.value.refused) == {bad_topic, too_large}
    assert f"dead letter {bad_topic}: " in str(refused.value) and "topic name 'bad topic'" in str(refused.value)
    assert f"dead letter {too_large}: " in str(refused.value) and "max_record_size" in str(refused.value)
    assert refused.value.replayed == len(ids)
    assert sorted(app.store.dead_letter_ids(unique)) == sorted([bad_topic, too_large])
    assert all(letter.replays == 0 for letter in app.dead_letters(unique))
    app.handler(unique, group=unique, token=None)(lambda msg, tx: None)
    app.run(until_idle=True)
    assert app.stats()["processed"] == len(ids)  # each once: none sent with a refused letter's neighbours twice
    app.close()


def test_an_id_given_twice_is_replayed_once_and_unknown_ids_are_all_named_before_any_change(
    tmp_path, unique
) -> None:
    """``--id 7 --id 7`` used to send letter 7 twice; of several unknown ids only the first was named."""
    store = f"sqlite:///{tmp_path / 'store.db'}"
    first, second = seed(store, unique, 2)
    app = embedded_app(tmp_path)
    with pytest.raises(DeadLetterNotFoundError, match=rf"no dead letter 999998, 999999 in group '{unique}'"):
        app.replay_dead_letters(unique, [first, 999999, 999998])
    with pytest.raises(DeadLetterNotFoundError, match="999999"):
        app.purge_dead_letters(unique, [first, 999999])
    assert app.store.dead_letter_ids(unique) == [first, second]  # nothing changed
    assert app.replay_dead_letters(unique, [first, first]) == 1
    app.handler(unique, group=unique, token=None)(lambda msg, tx: None)
    app.run(until_idle=True)
    assert app.stats()["processed"] == 1
    app.close()


def test_the_loop_guard_names_a_few_letters_changes_nothing_and_force_replays_them(tmp_path, unique) -> None:
    """A group of many looping letters used to be named in full: one line of every id."""
    store = f"sqlite:///{tmp_path / 'store.db'}"
    ids = seed(store, unique, 30)
    app = embedded_app(tmp_path)
    app.store.mark_replayed(ids)  # type: ignore[attr-defined]
    with pytest.raises(ReplayLoopError) as looping:
        app.replay_dead_letters(unique, max_replays=1)
    assert str(looping.value).startswith(f"dead letters {', '.join(map(str, ids[:20]))} and 10 more of group")
    assert app.store.dead_letter_ids(unique) == ids
    assert app.replay_dead_letters(unique, max_replays=1, force=True) == 30
    app.close()


def test_a_replay_cut_by_the_broker_going_down_says_what_it_did_and_the_rest_follow_later(
    tmp_path, postgres_url, unique
) -> None:
    """The error used to be the broker's words alone: nothing said how many letters went, or that
    the others were still there to replay."""
    from backends.errors import BackendUnavailableError
    from reliable import Middleware
    from tests.broker.server.serving import ServerProcess

    server = ServerProcess(tmp_path / "broker").start()

    class CutAfterFirstChunk(Middleware):
        def after_publish(self, publish, error) -> None:  # type: ignore[no-untyped-def]
            if publish.replay and server.running:
                server.kill()

    total = 3 * CHUNK
    seed(postgres_url, unique, total)
    env = {"RELIABLE_STORE__URL": postgres_url, "RELIABLE_TRANSPORT__URL": server.url, "RELIABLE_LOG__LEVEL": "warning"}
    app = App(Settings.load(None, env=env), middleware=[CutAfterFirstChunk()])
    with pytest.raises(BackendUnavailableError) as cut:
        app.replay_dead_letters(unique)
    assert f"replayed {CHUNK} of {total} dead letter(s) of group '{unique}'" in str(cut.value)
    assert "the others stay: replay again" in str(cut.value)
    app.close()
    assert len(SqlStore(postgres_url).dead_letter_ids(unique)) == total - CHUNK
    server.log.unlink()  # start() waits for the restarted server's own "listening" line
    server.start()
    try:
        app = App(Settings.load(None, env=env))
        assert app.replay_dead_letters(unique) == total - CHUNK
        app.close()
        stats = deliveries(postgres_url, server.url, unique, token="id")
        assert (stats["processed"], stats["duplicate"]) == (total, 0)
    finally:
        server.stop()


def test_dlq_list_pages_through_a_long_queue_with_after(tmp_path, unique) -> None:
    """`dlq list` showed the first --limit letters only, read in one query: past them no listing
    reached, and a large --limit held every letter before printing one."""
    from click.testing import CliRunner

    from reliable.cli import cli

    store = f"sqlite:///{tmp_path / 'store.db'}"
    ids = seed(store, unique, 1_200)
    (tmp_path / "reliable.toml").write_text(f'[store]\nurl = "{store}"\n[transport]\nurl = "memory://"\n')

    def listed(*args: str) -> list[int]:
        result = CliRunner().invoke(cli, ["dlq", "list", unique, "--settings", str(tmp_path / "reliable.toml"),
                                          *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return [json.loads(line)["id"] for line in result.stdout.splitlines()]

    first = listed("--limit", "1100", "--after", str(ids[49]))
    assert first == ids[50:1150]
    assert listed("--after", str(first[-1])) == ids[1150:]
    assert listed("--limit", "3") == ids[:3]


def test_dlq_replay_says_how_many_letters_another_replay_held(tmp_path, unique) -> None:
    """Letters a replay killed mid-send holds are skipped until its hold runs out: the command
    said only "replayed 10", as if the group had no more."""
    from click.testing import CliRunner

    from reliable.cli import cli

    store = f"sqlite:///{tmp_path / 'store.db'}"
    ids = seed(store, unique, 30)
    SqlStore(store).take_dead_letters(unique, ids[:20], HOLD)  # as a replay that died sending them
    (tmp_path / "reliable.toml").write_text(f'[store]\nurl = "{store}"\n[transport]\nurl = "memory://"\n'
                                            '[log]\nlevel = "warning"\n')
    result = CliRunner().invoke(cli, ["dlq", "replay", unique, "--settings", str(tmp_path / "reliable.toml")])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"replayed 10 dead letter(s) of {unique}\n"
    assert ("20 were held by another replay (one that stopped lets go of them within 60 s) or purged meanwhile: "
            "replay again for those left") in result.stderr
