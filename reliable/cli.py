"""The ``reliable`` command: run handlers, inspect and replay dead letters, check settings."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from backends.types import new_message_id
from backends.urls import redact
from broker.errors import BrokerError
from reliable.cli_broker import broker
from reliable.cli_console import console
from reliable.cli_outbox import outbox, relay
from reliable.cli_output import listening, progress_bar
from reliable.cli_target import load_app
from reliable.deadletter import HOLD
from reliable.errors import ReliableError

if TYPE_CHECKING:
    from backends.types import DeadLetter
    from reliable.app import App

# The framework (App, Settings: SQLAlchemy, pydantic, structlog) is imported by the commands that
# use it, not here: `reliable --help` and a usage error answer without loading it.

SETTINGS_HELP = "settings file (default: $RELIABLE_SETTINGS, else ./reliable.toml if present)"


@click.group()
@click.version_option(package_name="reliable", prog_name="reliable")
def cli() -> None:
    """reliable: idempotent, retrying, dead-lettering consumers."""


@cli.command()
@click.argument("target")
@click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)
@click.option("--handler", "handlers", multiple=True, help="run only these handlers (repeatable)")
@click.option("--until-idle", is_flag=True, help="return when nothing is left to deliver")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="serve HOST:PORT/metrics (Prometheus), /healthz and /readyz")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="the address the metrics port listens on (0.0.0.0: every interface, for a kubelet or a scraper)")
def run(target: str, settings_path: str | None, handlers: tuple[str, ...], until_idle: bool,
        metrics_port: int | None, metrics_host: str) -> None:
    """Run the handlers of MODULE:APP until stopped (Ctrl-C / SIGTERM finish gracefully)."""
    app = load_app(target, settings_path)  # its settings in effect before the probes can open the backends
    if metrics_port is not None:
        from reliable.health import serve_probes

        listening("--metrics-port", metrics_host, metrics_port,
                  lambda: int(serve_probes(app, metrics_port, metrics_host).server_address[1]),
                  "/metrics, /healthz and /readyz")
    app.run(until_idle=until_idle, handlers=list(handlers) or None)
    click.echo(json.dumps(app.stats(), sort_keys=True))


@cli.command()
@click.argument("topic")
@click.argument("body")
@click.option("--key", help="the message key (orders the messages of one key)")
@click.option("--id", "message_id", help="the message id (default: a random one, as uuid4 hex)")
@click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)
def publish(topic: str, body: str, key: str | None, message_id: str | None, settings_path: str | None) -> None:
    """Publish BODY (JSON text) to TOPIC; says the message's id (`reliable broker message --id`)."""
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise click.BadParameter(f"BODY is not JSON: {exc}") from exc
    app = _app(settings_path)
    message_id = message_id or new_message_id()  # drawn here, as a transport would, to be told
    app.publish(topic, value, key=key, message_id=message_id)
    app.close()
    click.echo(f"published message {message_id} to {topic}")


@cli.group()
def dlq() -> None:
    """Inspect, replay and purge the dead letters of your handlers (kept in the store).

    The one place for a framework user, whatever the transport. `reliable
    broker dlq` is for programs that use the broker directly.
    """


def _settings_option(func: Any) -> Any:
    return click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)(func)


def _app(settings_path: str | None) -> App:
    from reliable.app import App
    from reliable.settings import Settings

    return App(Settings.load(settings_path))


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def _summary(letter: DeadLetter) -> dict[str, Any]:
    m, f = letter.message, letter.failure
    return {
        "id": letter.id, "group": letter.group, "topic": m.topic, "queue": m.queue, "offset": m.offset,
        "message_id": m.id, "key": m.key, "token": letter.token, "attempts": f.attempts,
        "error_type": f.error_type, "error": f.error_message, "replays": letter.replays,
        "first_failure": _when(f.first_failure_at), "last_failure": _when(f.last_failure_at),
    }


LIST_PAGE = 500
"""Letters read per query by `dlq list`: a long listing is printed as it is read, never held whole."""


def _none_in(app: App, group: str) -> None:
    """Say on stderr that ``group`` has no dead letters, naming the groups that have some: a
    misspelt group would otherwise pass for an empty one."""
    others = [g for g in app.store.dead_letter_groups() if g != group]
    known = f"; groups with dead letters: {', '.join(others)}" if others else ""
    click.echo(f"group {group!r} has no dead letters{known}", err=True)


@dlq.command("list")
@click.argument("group")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--after", "after_id", type=click.IntRange(min=0), default=0,
              help="only letters with a larger id (the last id of the previous listing)")
@_settings_option
def dlq_list(group: str, limit: int, after_id: int, settings_path: str | None) -> None:
    """List the dead letters of GROUP, oldest first, one JSON object a line."""
    app = _app(settings_path)
    letters, listed = app.dead_letter_queue, after_id
    while limit > 0 and (page := letters.page(group, min(limit, LIST_PAGE), after_id, body_limit=0)):
        for letter in page:
            click.echo(json.dumps(_summary(letter)))
        limit, after_id = limit - len(page), page[-1].id or after_id
    if after_id == listed == 0:
        _none_in(app, group)


@dlq.command("show")
@click.argument("letter_id", type=int)
@_settings_option
def dlq_show(letter_id: int, settings_path: str | None) -> None:
    """Show one dead letter in full: headers, body and traceback."""
    letter = _app(settings_path).dead_letter_queue.get(letter_id)
    if letter is None:
        raise click.ClickException(f"no dead letter {letter_id}")
    detail = _summary(letter)
    detail["headers"] = dict(letter.message.headers)
    detail["payload"] = letter.message.payload.decode("utf-8", errors="backslashreplace")
    detail["traceback"] = letter.failure.traceback
    click.echo(json.dumps(detail, indent=2))


@dlq.command("replay")
@click.argument("group")
@click.option("--id", "ids", type=int, multiple=True, help="replay only these ids (repeatable)")
@click.option("--max-replays", type=click.IntRange(min=0), default=3, show_default=True, help="refuse letters replayed this often")
@click.option("--force", is_flag=True, help="replay even letters past --max-replays")
@_settings_option
def dlq_replay(group: str, ids: tuple[int, ...], max_replays: int, force: bool, settings_path: str | None) -> None:
    """Publish dead letters of GROUP back to GROUP only (a progress bar in a terminal)."""
    app = _app(settings_path)
    letters = app.dead_letter_queue
    if not (total := len(set(ids)) or letters.count(group)):
        _none_in(app, group)
    with progress_bar(total, f"replaying dead letters of {group}") as bar:
        count = letters.replay(group, list(ids) or None, max_replays=max_replays, force=force,
                               progress=lambda done: bar.advance(bar.task_ids[0], done))
    click.echo(f"replayed {count} dead letter(s) of {group}")
    if 0 < total - count:
        click.echo(f"{total - count} were held by another replay (one that stopped lets go of them within "
                   f"{HOLD:.0f} s) or purged meanwhile: replay again for those left", err=True)


@dlq.command("purge")
@click.argument("group")
@click.option("--id", "ids", type=int, multiple=True, help="purge only these ids (repeatable)")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@_settings_option
def dlq_purge(group: str, ids: tuple[int, ...], yes: bool, settings_path: str | None) -> None:
    """Delete dead letters of GROUP without replaying them."""
    app = _app(settings_path)
    letters = app.dead_letter_queue
    if not (total := len(set(ids)) or letters.count(group)):
        _none_in(app, group)
    elif not yes:
        click.confirm(f"delete {'the chosen' if ids else 'all'} dead letters of {group}?", abort=True)
    with progress_bar(total, f"purging dead letters of {group}") as bar:
        count = letters.purge(group, list(ids) or None, progress=lambda done: bar.advance(bar.task_ids[0], done))
    click.echo(f"purged {count} dead letter(s) of {group}")


cli.add_command(broker)
cli.add_command(relay)
cli.add_command(outbox)
cli.add_command(console)


@cli.command("settings")
@_settings_option
def show_settings(settings_path: str | None) -> None:
    """Validate the settings file and print the effective settings (passwords as ***)."""
    from reliable.settings import Settings

    click.echo(json.dumps(_without_secrets(Settings.load(settings_path).model_dump(mode="json")), indent=2))


def _without_secrets(value: Any) -> Any:
    """``value`` with URL passwords and every ``*password*`` key shown as ``***``: the output of
    `reliable settings` gets pasted into issues and chats."""
    if isinstance(value, dict):
        return {k: "***" if "password" in k else _without_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_secrets(v) for v in value]
    return redact(value) if isinstance(value, str) and "://" in value else value


def main() -> None:
    try:
        cli(standalone_mode=True)
    except (ReliableError, BrokerError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
