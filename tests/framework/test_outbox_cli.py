"""``reliable relay`` and ``reliable outbox status | list | retry`` as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest

from backends.store import SqlStore
from backends.store.outbox import OutboxStatus, RowState
from backends.transport import open_transport
from reliable.testing import test_app
from tests.waiting import wait_until


def reliable_exe() -> str:
    return shutil.which("reliable", path=str(Path(sys.executable).parent)) or "reliable"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    return {**env, **extra}


def listening_backend(postgres_url: str, outbox: str) -> list[int]:
    """The server pids of the connections that LISTEN for ``outbox`` (named after it)."""
    with psycopg.connect(postgres_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as connection:
        rows = connection.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                                  (f"reliable outbox {outbox}",)).fetchall()
    return [pid for (pid,) in rows]


def waiting_after(lines: list[str], event: str, nth: int) -> bool:
    """Whether the relay logged ``event`` ``nth`` times and went to wait after the last."""
    seen = [n for n, line in enumerate(lines) if event in line]
    return len(seen) >= nth and any('"relay_waiting"' in line for line in lines[seen[nth - 1]:])


@pytest.mark.parametrize("cut", [False, True], ids=["listening", "listening again after its connection was cut"])
def test_a_standalone_relay_is_woken_by_a_commit_in_another_process(
    postgres_url: str, reliable_server, tmp_path: Path, unique: str, cut: bool
) -> None:
    settings = tmp_path / "reliable.toml"
    settings.write_text(
        f'[transport]\nurl = "{reliable_server.url}"\n[store]\nurl = "{postgres_url}"\n'
        f'[outbox]\nname = "{unique}"\npoll_interval = "1h"\n'  # only a NOTIFY can wake it in time
        '[log]\nlevel = "debug"\nformat = "json"\n'
    )
    relay = subprocess.Popen([reliable_exe(), "relay", "--settings", str(settings)], env=clean_env(),
                             stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    idle = threading.Event()  # LISTEN is on, and the relay went to wait after it

    def follow() -> None:
        assert relay.stderr is not None
        listening = False
        for line in relay.stderr:
            lines.append(line)
            listening = listening or '"outbox.listening"' in line
            if listening and '"relay_waiting"' in line:
                idle.set()

    threading.Thread(target=follow, daemon=True).start()
    try:
        assert idle.wait(60), "".join(lines)[-3000:]
        if cut:  # the server ends the LISTEN connection (a restart or an idle-session killer would)
            [pid] = listening_backend(postgres_url, unique)
            with psycopg.connect(postgres_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as admin:
                assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
            wait_until(lambda: waiting_after(lines, '"outbox.listening"', 2), "the relay to LISTEN again and wait",
                       timeout=60)
            assert any('"outbox.listen_failed"' in line for line in lines)
            assert listening_backend(postgres_url, unique) not in ([], [pid])
        store = SqlStore(postgres_url, outbox=unique)
        with store.transaction() as tx:
            ids = [tx.publish(f"{unique}-events", {"n": n}, key="k") for n in range(5)]
        store.close()
        transport = open_transport(reliable_server.url)
        got = []
        with transport.subscribe(unique, [f"{unique}-events"]) as subscription:
            while len(got) < 5:
                batch = subscription.fetch(5, timeout=30.0)
                assert batch, f"the relay sent {len(got)} of 5 rows: {''.join(lines)[-3000:]}"
                subscription.ack(batch)
                got += batch
        transport.close()
        assert [m.id for m in got] == ids
        assert [m.body["n"] for m in got] == list(range(5))
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(60) == 0, "".join(lines)[-3000:]


def test_a_standalone_relay_of_an_app_declares_its_groups_on_a_queue_broker(
    amqp_url: str, tmp_path: Path, unique: str
) -> None:
    """amqp:// refuses a publish no queue would take (the row goes FAILED, its key waits for a
    retry): the relay of ``MODULE:APP`` declares the app's groups first, so the messages wait in
    the group's queue for a worker that joins later."""
    url = f"{amqp_url}?namespace={unique}"
    (tmp_path / f"{unique}_app.py").write_text(
        "from reliable import App\n"
        "app = App()\n"
        f"@app.handler('{unique}-events', group='{unique}-billing')\n"
        "def bill(message, tx):\n"
        "    pass\n"
    )
    settings = tmp_path / "reliable.toml"
    settings.write_text(f'[transport]\nurl = "{url}"\n[store]\nurl = "sqlite:///{tmp_path / "store.db"}"\n'
                        f'[outbox]\nname = "{unique}"\n[log]\nlevel = "warning"\n')
    store = SqlStore(f"sqlite:///{tmp_path / 'store.db'}", outbox=unique)
    with store.transaction() as tx:
        ids = [tx.publish(f"{unique}-events", {"n": n}, key="k") for n in range(5)]
    relay = subprocess.Popen([reliable_exe(), "relay", f"{unique}_app:app", "--settings", str(settings)],
                             env=clean_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    transport = open_transport(url)
    try:
        def settled() -> OutboxStatus | None:
            status = store.outbox.status()
            return status if status.sent == 5 or status.failed or relay.poll() is not None else None

        status = wait_until(settled, "the relay sent or refused the rows")
        assert relay.poll() is None, relay.communicate()[1][-3000:]
        assert status.failed == 0, store.outbox.rows(RowState.FAILED)[0].error
        got = []
        with transport.subscribe(f"{unique}-billing", [f"{unique}-events"]) as subscription:  # joins only now
            while len(got) < 5:
                batch = subscription.fetch(5, timeout=10.0)
                assert batch, f"the group's queue kept {len(got)} of the 5 messages sent"
                subscription.ack(batch)
                got += batch
        assert [m.id for m in got] == ids
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(60) == 0, relay.communicate()[1][-3000:]
        store.close()
        transport.purge()
        transport.close()


def test_status_list_and_retry_show_and_release_a_row_the_transport_refused(tmp_path: Path, unique: str) -> None:
    env = {"RELIABLE_OUTBOX__NAME": unique}
    app = test_app(tmp_path, transport=f"embedded://{tmp_path / 'broker'}", settings=env)
    with app.store.transaction() as tx:
        tx.publish("orders", "x" * 5_000_000, key="k")  # above the broker's max_record_size: refused
        tx.publish("orders", {"n": 2}, key="k")  # waits behind it: same key
        tx.publish("orders", {"n": 3}, key="other")
    assert app.relay().drain()
    app.close()
    settings = tmp_path / "reliable.toml"
    settings.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "store.db"}"\n'
                        f'[transport]\nurl = "embedded://{tmp_path / "broker"}"\n[outbox]\nname = "{unique}"\n'
                        '[log]\nlevel = "warning"\n')

    def reliable(*args: str) -> str:
        done = subprocess.run([reliable_exe(), *args, "--settings", str(settings)], env=clean_env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    status = json.loads(reliable("outbox", "status"))
    assert (status["pending"], status["failed"], status["sent"]) == (1, 1, 1)
    assert status["oldest_unsent_age_seconds"] >= 0 and status["oldest_unsent"]
    [failed] = [json.loads(line) for line in reliable("outbox", "list", "--state", "failed").splitlines()]
    assert (failed["topic"], failed["key"], failed["bytes"]) == ("orders", "k", 5_000_002)
    assert "max_record_size" in failed["error"]
    assert len(reliable("outbox", "list").splitlines()) == 3
    assert reliable("outbox", "retry", "--id", str(failed["id"])).startswith("1 failed row(s)")
    status = json.loads(reliable("outbox", "status"))
    assert (status["pending"], status["failed"]) == (2, 0)
    # an id that is no failed row (now pending; never written) is named, not passed over as "0 rows"
    again = subprocess.run([reliable_exe(), "outbox", "retry", "--id", str(failed["id"]), "--id", "999999",
                            "--settings", str(settings)], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert (again.returncode, again.stdout) == (1, "0 failed row(s) pending again\n")
    assert again.stderr == (f"Error: row(s) {failed['id']}, 999999 of outbox '{unique}' not failed (pending, sent or "
                            "no such row): left as they were; `reliable outbox list --state failed` lists the failed ones\n")


def test_the_outbox_commands_are_listed() -> None:
    done = subprocess.run([reliable_exe(), "outbox", "--help"], env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    assert all(command in done.stdout for command in ("status", "list", "retry"))
    done = subprocess.run([reliable_exe(), "--help"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert "relay" in done.stdout
