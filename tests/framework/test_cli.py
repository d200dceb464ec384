"""The `reliable` command as a user runs it: run, dlq list/show/replay/purge, settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reliable.cli import cli
from tests import forked

APP_MODULE = '''
import reliable
from sqlalchemy import text

app = reliable.App()

@app.handler("payments", group="billing", token="body.payment_id", fatal=(ValueError,))
def charge(msg, tx):
    if msg.body["amount"] <= 0:
        raise ValueError("amount must be positive")
    tx.execute(text("create table if not exists charges (id text primary key)"))
    tx.execute(text("insert into charges (id) values (:i)"), {"i": msg.body["payment_id"]})

if __name__ == "__main__":
    for p in ({"payment_id": "p-1", "amount": 10}, {"payment_id": "p-1", "amount": 10},
              {"payment_id": "p-2", "amount": -1}):
        app.publish("payments", p)
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "billing_app.py").write_text(APP_MODULE)
    (tmp_path / "reliable.toml").write_text(
        '[transport]\nurl = "embedded://./data/broker"\n'
        '[store]\nurl = "sqlite:///./data/reliable.db"\n'
        '[log]\nlevel = "warning"\nformat = "json"\n'
    )
    return tmp_path


def reliable_cmd(project: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``reliable ARGS`` in a process of its own, forked from the fork server (`tests.forked`):
    `test_version` runs the installed ``reliable`` script itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    return forked.reliable(args, project, env, input=input)


def publish_payments(project: Path, env: dict[str, str]) -> None:
    """``python billing_app.py``: its three payments published (forked as `reliable_cmd`)."""
    done = forked.python(["billing_app.py"], project, env)
    assert done.returncode == 0, done.stderr


def test_run_then_inspect_replay_and_purge_dead_letters(project: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env["RELIABLE_SETTINGS"] = str(project / "reliable.toml")
    publish_payments(project, env)

    run = reliable_cmd(project, "run", "billing_app:app", "--settings", "reliable.toml", "--until-idle")
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert (stats["processed"], stats["duplicate"], stats["dead_lettered"]) == (1, 1, 1)

    listed = reliable_cmd(project, "dlq", "list", "billing", "--settings", "reliable.toml")
    [letter] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["token"] == "p-2" and letter["error_type"] == "builtins.ValueError" and letter["attempts"] == 1

    shown = json.loads(reliable_cmd(project, "dlq", "show", str(letter["id"]), "--settings", "reliable.toml").stdout)
    assert json.loads(shown["payload"]) == {"payment_id": "p-2", "amount": -1}
    assert "ValueError: amount must be positive" in shown["traceback"]

    replayed = reliable_cmd(project, "dlq", "replay", "billing", "--settings", "reliable.toml")
    assert "replayed 1" in replayed.stdout, replayed.stderr
    rerun = reliable_cmd(project, "run", "billing_app:app", "--settings", "reliable.toml", "--until-idle")
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["dead_lettered"] == 1
    [again] = [json.loads(x) for x in reliable_cmd(project, "dlq", "list", "billing", "--settings", "reliable.toml").stdout.splitlines()]
    assert again["replays"] == 1
    looping = reliable_cmd(project, "dlq", "replay", "billing", "--max-replays", "1", "--settings", "reliable.toml")
    assert looping.returncode != 0 and "--force on the command line" in looping.stderr, looping.stderr

    purged = reliable_cmd(project, "dlq", "purge", "billing", "--yes", "--settings", "reliable.toml")
    assert "purged 1" in purged.stdout
    assert reliable_cmd(project, "dlq", "list", "billing", "--settings", "reliable.toml").stdout == ""


def test_a_group_without_dead_letters_names_the_groups_that_have_some(project: Path) -> None:
    """A misspelt group passed for an empty one: `dlq replay billingg` said only "replayed 0
    dead letter(s) of billingg", and `dlq purge billingg` asked to delete them all first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    publish_payments(project, env)
    assert reliable_cmd(project, "run", "billing_app:app", "--until-idle").returncode == 0

    note = "group 'billingg' has no dead letters; groups with dead letters: billing\n"
    listed = reliable_cmd(project, "dlq", "list", "billingg")
    assert (listed.returncode, listed.stdout, listed.stderr) == (0, "", note)
    replayed = reliable_cmd(project, "dlq", "replay", "billingg")
    assert (replayed.returncode, replayed.stdout, replayed.stderr) == (0, "replayed 0 dead letter(s) of billingg\n", note)
    purged = reliable_cmd(project, "dlq", "purge", "billingg", input="")  # nothing to confirm
    assert (purged.returncode, purged.stdout, purged.stderr) == (0, "purged 0 dead letter(s) of billingg\n", note)
    assert reliable_cmd(project, "dlq", "list", "billing").stderr == ""  # a group with letters: no note


def test_a_dead_letter_on_embedded_is_replayed_once_and_never_again_from_the_broker_dlq(project: Path) -> None:
    """One user-facing place: `reliable dlq replay` replays the letter; the broker's %DLQ%billing
    holds no copy of it, so `reliable broker dlq replay billing` delivers nothing again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    publish_payments(project, env)
    first = reliable_cmd(project, "run", "billing_app:app", "--settings", "reliable.toml", "--until-idle")
    assert json.loads(first.stdout.strip().splitlines()[-1])["dead_lettered"] == 1, first.stderr

    replayed = reliable_cmd(project, "dlq", "replay", "billing", "--settings", "reliable.toml")
    assert "replayed 1 dead letter(s) of billing" in replayed.stdout, replayed.stderr
    rerun = reliable_cmd(project, "run", "billing_app:app", "--settings", "reliable.toml", "--until-idle")
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["dead_lettered"] == 1  # the replay ran the handler

    broker_listed = reliable_cmd(project, "broker", "dlq", "list", "billing", "--settings", "reliable.toml", "--json")
    assert broker_listed.returncode == 0 and broker_listed.stdout == "", broker_listed.stderr
    broker_replay = reliable_cmd(project, "broker", "dlq", "replay", "billing", "--settings", "reliable.toml",
                                 "--json")
    assert broker_replay.returncode == 0, broker_replay.stderr
    assert json.loads(broker_replay.stdout.strip().splitlines()[-1]) == {"group": "billing", "replayed": 0}
    last = reliable_cmd(project, "run", "billing_app:app", "--settings", "reliable.toml", "--until-idle")
    stats = json.loads(last.stdout.strip().splitlines()[-1])
    assert (stats["processed"], stats["duplicate"], stats["dead_lettered"]) == (0, 0, 0)  # nothing delivered again
    letters = [json.loads(x) for x in reliable_cmd(project, "dlq", "list", "billing", "--settings",
                                                   "reliable.toml").stdout.splitlines()]
    assert [(letter["token"], letter["replays"]) for letter in letters] == [("p-2", 1)]


def test_publish_from_the_shell_then_run(project: Path) -> None:
    """`reliable publish` said only "published to payments": the message's id, which finds it,
    was drawn by the transport and never told."""
    published = reliable_cmd(project, "publish", "payments", '{"payment_id": "p-7", "amount": 3}',
                             "--settings", "reliable.toml")
    assert published.returncode == 0, published.stderr
    assert re.fullmatch(r"published message [0-9a-f]{32} to payments\n", published.stdout), published.stdout
    drawn = published.stdout.split()[2]
    found = reliable_cmd(project, "broker", "message", "--id", drawn, "--settings", "reliable.toml", "--json")
    [message] = [json.loads(line) for line in found.stdout.splitlines()]
    assert (message["topic"], json.loads(message["body"])) == ("payments", {"payment_id": "p-7", "amount": 3})
    named = reliable_cmd(project, "publish", "payments", '{"payment_id": "p-7", "amount": 3}', "--id", "pay-7",
                         "--settings", "reliable.toml")
    assert named.stdout == "published message pay-7 to payments\n", named.stderr
    bad = reliable_cmd(project, "publish", "payments", "{not json", "--settings", "reliable.toml")
    assert bad.returncode != 0 and "BODY is not JSON" in bad.stderr
    run = reliable_cmd(project, "run", "billing_app:app", "--settings", "reliable.toml", "--until-idle")
    assert json.loads(run.stdout.strip().splitlines()[-1])["processed"] == 1, run.stderr


def test_bad_settings_are_reported_with_file_key_value_and_allowed(project: Path) -> None:
    (project / "bad.toml").write_text('[commit]\nstrategy = "sometimes"\n')
    result = reliable_cmd(project, "settings", "--settings", "bad.toml")
    assert result.returncode == 2
    assert "bad.toml" in result.stderr and "commit.strategy" in result.stderr and "'sometimes'" in result.stderr
    assert "per_message" in result.stderr


def test_run_rejects_a_target_that_is_not_an_app(project: Path) -> None:
    result = reliable_cmd(project, "run", "billing_app:text")
    assert result.returncode != 0 and "is not a reliable.App" in result.stderr


def test_broker_topics_groups_and_lag_from_the_shell(project: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    publish_payments(project, env)
    topics = reliable_cmd(project, "broker", "topics", "--settings", "reliable.toml", "--json")
    [payments] = [row for row in map(json.loads, topics.stdout.splitlines()) if row["name"] == "payments"]
    assert payments["queues"] == 4 and payments["messages"] == 3 and payments["bytes"] > 0
    reliable_cmd(project, "run", "billing_app:app", "--settings", "reliable.toml", "--until-idle")
    lag = [json.loads(x) for x in reliable_cmd(project, "broker", "lag", "billing", "--settings",
                                                "reliable.toml", "--json").stdout.splitlines()]
    assert sum(q["end"] - q["committed"] for q in lag if q["topic"] == "payments") == 0
    misspelt = reliable_cmd(project, "broker", "lag", "billingg", "--settings", "reliable.toml")
    assert misspelt.returncode == 0 and "no group 'billingg' on this broker; groups: " in misspelt.stderr
    assert "billing" in misspelt.stderr.split("groups: ")[1].strip().split(", "), misspelt.stderr  # was "(none)"
    table = reliable_cmd(project, "broker", "groups", "--settings", "reliable.toml")
    assert table.stdout.splitlines()[0].split() == ["name", "topics", "members", "broadcast"]
    [billing] = [line for line in table.stdout.splitlines() if line.startswith("billing ")]
    assert billing.split()[:3] == ["billing", "%RETRY%billing,", "payments"]  # was "('%RETRY%billing', 'payments')"
    refused = reliable_cmd(project, "broker", "topics", "--url", "reliable://127.0.0.1:1")
    assert refused.returncode == 2 and "unreachable" in refused.stderr


def test_run_with_a_misspelt_app_names_the_module_and_the_attribute(project: Path) -> None:
    result = reliable_cmd(project, "run", "billing_app:ap")
    assert result.returncode != 0
    assert "module 'billing_app' has no attribute 'ap'; it has app" in result.stderr


def test_version(project: Path) -> None:
    exe = shutil.which("reliable", path=str(Path(sys.executable).parent)) or "reliable"
    result = subprocess.run([exe, "--version"], cwd=project, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("reliable, version ")


@pytest.mark.parametrize("args", [
    ["dlq", "list", "billing", "--limit", "0"], ["dlq", "list", "billing", "--limit", "-5"],
    ["dlq", "replay", "billing", "--max-replays", "-1"],
    ["outbox", "list", "--limit", "-1"], ["outbox", "list", "--after", "-1"],
    ["broker", "dlq", "list", "billing", "--limit", "0"],
    ["broker", "message", "payments", "--key", "k", "--limit", "-1"],
    ["relay", "--metrics-port", "-1"], ["run", "billing_app:app", "--metrics-port", "70000"],  # a traceback before
])
def test_a_count_out_of_range_is_refused_by_name(project: Path, args: list[str]) -> None:
    """SQLite reads LIMIT -5 as no limit at all (every letter of a group, listed), PostgreSQL
    refuses it with a traceback: a count must be in range before anything is opened."""
    result = CliRunner().invoke(cli, [*args, "--settings", str(project / "reliable.toml")])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{args[-2]}'" in result.output
    assert not (project / "data").exists()  # refused before the backends opened


def test_settings_prints_no_password(tmp_path: Path) -> None:
    """`reliable settings` printed the store's and cache's passwords and the broker users'
    password hashes as they were written; its output gets pasted where secrets must not go."""
    settings = tmp_path / "reliable.toml"
    settings.write_text('[store]\nurl = "postgresql+psycopg://app:s3cret@db:5432/app"\n'
                        '[cache]\nurl = "redis://:hunter2@127.0.0.1:6379/0"\n'
                        '[broker.users.ops]\npassword_hash = "scrypt$16384$8$1$c2FsdA$aGFzaA"\nadmin = true\n')
    result = CliRunner().invoke(cli, ["settings", "--settings", str(settings)])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["store"]["url"] == "postgresql+psycopg://app:***@db:5432/app"
    assert shown["cache"]["url"] == "redis://:***@127.0.0.1:6379/0"
    assert shown["broker"]["users"]["ops"] == {"password_hash": "***", "admin": True}
    assert not any(secret in result.output for secret in ("s3cret", "hunter2", "aGFzaA"))


@pytest.mark.parametrize("command", [["run", "billing_app:app", "--until-idle"], ["relay"]])
def test_a_metrics_port_in_use_is_refused_by_name(project: Path, command: list[str]) -> None:
    """A port another program holds ended `reliable run --metrics-port` in a traceback
    ("OSError: [Errno 98] Address already in use")."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = reliable_cmd(project, *command, "--metrics-port", str(port))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (f"Invalid value for '--metrics-port': cannot listen on 127.0.0.1:{port}: Address already in use; "
            "choose another port (0: any free one)") in result.stderr


def test_metrics_port_0_says_which_port_it_bound(project: Path) -> None:
    """``--metrics-port 0`` is allowed (any free port) and was never told."""
    result = reliable_cmd(project, "run", "billing_app:app", "--until-idle", "--metrics-port", "0")
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("serving ")]
    assert line.startswith("serving /metrics, /healthz and /readyz on http://127.0.0.1:")
    assert int(line.rsplit(":", 1)[1]) > 0


@pytest.mark.parametrize("command", [["console", "--port", "0"], ["broker", "serve", "--data-dir", "data/server"]])
def test_the_console_without_its_extra_names_the_extra(project: Path, command: list[str]) -> None:
    """Without `reliable[console]` installed, `reliable console` (and a broker server with a
    console_port) ended in "ModuleNotFoundError: No module named 'uvicorn'" and a traceback."""
    settings = project / "console.toml"
    settings.write_text((project / "reliable.toml").read_text() + "[broker]\nport = 0\nconsole_port = 0\n")
    without_uvicorn = "import sys; sys.modules['uvicorn'] = None; from reliable.cli import main; main()"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    result = subprocess.run([sys.executable, "-c", without_uvicorn, *command, "--settings", str(settings)],
                            cwd=project, env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, "Traceback" in result.stderr) == (2, False), result.stderr
    assert result.stderr.endswith("error: the web console needs uvicorn: pip install 'reliable[console]'\n")


OPENS_AT_IMPORT = '''
import reliable
from sqlalchemy import text

app = reliable.App()

@app.handler("payments", group="billing", token="body.payment_id")
def charge(msg, tx):
    tx.execute(text("insert into charges (id) values (:i)"), {"i": msg.body["payment_id"]})

with app.store.transaction() as tx:  # the backends open while the module is imported
    tx.execute(text("create table if not exists charges (id text primary key)"))
'''


def test_run_settings_are_in_effect_while_an_app_that_opens_at_import_is_imported(project: Path) -> None:
    """`reliable run MODULE:APP --settings FILE` ended in "RuntimeError: settings cannot change
    after the backends are open" when the module's ``App()`` opened its backends at import."""
    (project / "opens_app.py").write_text(OPENS_AT_IMPORT)
    (project / "elsewhere.toml").write_text('[transport]\nurl = "embedded://./elsewhere/broker"\n'
                                            '[store]\nurl = "sqlite:///./elsewhere/reliable.db"\n')
    published = reliable_cmd(project, "publish", "payments", '{"payment_id": "p-1"}', "--settings", "elsewhere.toml")
    assert published.returncode == 0, published.stderr
    run = reliable_cmd(project, "run", "opens_app:app", "--until-idle", "--settings", "elsewhere.toml")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["processed"] == 1
    assert not (project / "data").exists()  # nothing opened on ./reliable.toml, the file it would find alone


def test_run_accepts_the_settings_an_app_opened_on_at_import_and_refuses_others(project: Path) -> None:
    """The main example opens its backends at import on examples/payments.toml: `reliable run
    examples.payments:app --settings examples/payments.toml`, as README tells, ended in a traceback."""
    examples = Path(__file__).parents[2] / "examples"
    (project / "examples").mkdir()
    for name in ("__init__.py", "payments.py", "payments.toml"):
        shutil.copy(examples / name, project / "examples" / name)
    same = reliable_cmd(project, "run", "examples.payments:app", "--until-idle", "--settings", "examples/payments.toml")
    assert same.returncode == 0 and "Traceback" not in same.stderr, same.stderr

    other = reliable_cmd(project, "run", "examples.payments:app", "--until-idle", "--settings", "reliable.toml")
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr
    assert ("Error: --settings reliable.toml: examples.payments:app opened its backends while its module was "
            "imported, on other settings (log.format, log.level, store.url, transport.url differ)") in other.stderr
    assert "build the app with reliable.App() (it reads --settings), or leave out --settings" in other.stderr
