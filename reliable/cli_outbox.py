"""``reliable relay`` and ``reliable outbox``: the standalone relay, and the outbox's backlog.

``reliable relay --settings reliable.toml`` sends the outbox named by
``[outbox] name`` to the transport of ``[transport]`` until SIGINT/SIGTERM,
next to (or instead of, with ``outbox.relay = false``) the relays inside the
workers. ``reliable relay MODULE:APP`` relays that app's outbox and, like its
workers, declares the app's groups on a topic before its first publish there
(a queue broker, ``amqp://``, keeps a message only for the groups it knows). ``reliable outbox status | list | retry`` show the backlog and the
oldest unsent row, list rows, and make rows the transport refused pending again.
"""

from __future__ import annotations

import json
import signal
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from backends.store.outbox import OutboxRow, RowState
from reliable.cli_output import listening
from reliable.cli_target import load_app

if TYPE_CHECKING:
    from reliable.app import App

SETTINGS_HELP = "settings file (default: $RELIABLE_SETTINGS, else ./reliable.toml if present)"


def _settings_option(func: Any) -> Any:
    return click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)(func)


def _app(settings_path: str | None) -> App:
    from reliable.app import App
    from reliable.settings import Settings

    return App(Settings.load(settings_path))


def _when(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


@click.command()
@click.argument("target", required=False)
@_settings_option
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="serve Prometheus metrics on 127.0.0.1:PORT/metrics")
def relay(target: str | None, settings_path: str | None, metrics_port: int | None) -> None:
    """Send the outbox's committed rows to the transport until stopped (Ctrl-C / SIGTERM).

    With MODULE:APP, the groups of that app's handlers are declared on a topic
    before its first publish there (amqp:// keeps messages only for known groups).
    """
    app = _app(settings_path) if target is None else load_app(target, settings_path)
    if metrics_port is not None:
        from reliable.metrics import serve_metrics

        listening("--metrics-port", "127.0.0.1", metrics_port, lambda: serve_metrics(metrics_port), "/metrics")
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with app.relay().running(stop):
            while not stop.wait(0.5):
                pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        app.close()


@click.group()
def outbox() -> None:
    """Show the outbox's backlog, list its rows, retry rows the transport refused."""


@outbox.command("status")
@_settings_option
def outbox_status(settings_path: str | None) -> None:
    """The backlog: rows pending, failed and sent, and the oldest unsent row's age."""
    app = _app(settings_path)
    status = app.store.outbox.status()
    click.echo(json.dumps({
        "outbox": status.outbox, "pending": status.backlog, "failed": status.failed, "sent": status.sent,
        "oldest_unsent": _when(status.oldest_unsent_at),
        "oldest_unsent_age_seconds": round(status.oldest_unsent_age(app.clock.time()), 3),
    }))


def _summary(row: OutboxRow) -> dict[str, Any]:
    return {
        "id": row.id, "message_id": row.message_id, "topic": row.topic, "key": row.key, "state": row.state.value,
        "written": _when(row.created_at), "sent": _when(row.sent_at), "error": row.error,
        "bytes": len(row.payload),
    }


@outbox.command("list")
@click.option("--state", type=click.Choice([s.value for s in RowState]), help="only rows in this state")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--after", "after_id", type=click.IntRange(min=0), default=0, help="only rows with a greater id (paging)")
@_settings_option
def outbox_list(state: str | None, limit: int, after_id: int, settings_path: str | None) -> None:
    """List outbox rows, oldest first, one JSON object a line."""
    rows = _app(settings_path).store.outbox.rows(RowState(state) if state else None, limit=limit, after_id=after_id)
    for row in rows:
        click.echo(json.dumps(_summary(row)))


@outbox.command("retry")
@click.option("--id", "ids", type=int, multiple=True, help="retry only these row ids (repeatable)")
@_settings_option
def outbox_retry(ids: tuple[int, ...], settings_path: str | None) -> None:
    """Make rows the transport refused (failed) pending again, so a relay sends them."""
    store = _app(settings_path).store.outbox
    retried = store.retry(list(ids) or None)
    click.echo(f"{len(retried)} failed row(s) pending again")
    if missed := sorted(set(ids) - set(retried)):
        raise click.ClickException(
            f"row(s) {', '.join(map(str, missed))} of outbox {store.name!r} not failed (pending, sent or no such "
            "row): left as they were; `reliable outbox list --state failed` lists the failed ones")
