"""``reliable broker ...``: serve the broker, and look into one (topics, groups, lag).

``serve`` runs the broker server of the ``[broker]`` table of the settings
file. The other commands reach a broker by URL: ``--url reliable://host:port``
(a server) or ``--url embedded://DIR`` (a directory: its owner's socket, or
the directory itself when no process owns it); without ``--url``, the
settings' transport URL. Tables in a terminal, JSON lines with ``--json``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import click

from broker.console.config import require_console_packages
from reliable.cli_output import progress_bar, show_table

SETTINGS_HELP = "settings file (default: $RELIABLE_SETTINGS, else ./reliable.toml if present)"


@click.group()
def broker() -> None:
    """The project's broker: serve it, inspect it."""


@broker.command()
@click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)
@click.option("--data-dir", help="the store's directory (default: [broker] data_dir)")
@click.option("--host", help="address to bind (default 127.0.0.1)")
@click.option("--port", type=int, help="native protocol port (default 7600)")
@click.option("--metrics", "metrics", multiple=True, metavar="URL",
              help="a worker's /metrics URL (`reliable run --metrics-port`), for the console's "
                   "handlers' counters (repeatable; needs [broker] console_port)")
def serve(settings_path: str | None, data_dir: str | None, host: str | None, port: int | None,
          metrics: tuple[str, ...]) -> None:
    """Serve the broker over TCP until SIGTERM / Ctrl-C (graceful: offsets and checkpoint written)."""
    from broker.server.run import run, settings_table
    from reliable.log import configure_logging

    configure_logging("info")
    table = settings_table(settings_path)
    framework: dict[str, Any] = {}
    if table.get("console_port", False) is not False:  # the console shows the framework's side too
        from reliable.app import App
        from reliable.settings import Settings

        require_console_packages()
        from reliable.console import OutboxBacklog, StoreLetters, WorkerCounters

        app = App(Settings.load(settings_path))
        framework = {"letters": StoreLetters(app), "backlog": OutboxBacklog(app),
                     "counters": WorkerCounters(metrics) if metrics else None}
    elif metrics:
        raise click.BadParameter("the handlers' counters are shown by the console: set [broker] "
                                 "console_port in the settings file", param_hint="--metrics")
    run(table, data_dir=data_dir, host=host, port=port, **framework)


@contextmanager
def _api(url: str | None, settings_path: str | None) -> Iterator[Any]:
    from reliable.log import configure_logging
    from reliable.settings import Settings

    configure_logging("warning")  # the output is the table (or JSON); logs go to stderr
    url = url or Settings.load(settings_path).transport.url
    scheme, _, rest = url.partition("://")
    if scheme in ("reliable", "unix"):
        from broker.client import Client

        api: Any = Client(url)
    elif scheme == "embedded":
        from broker.embedded import open_embedded

        api = open_embedded(rest.partition("?")[0] or ".reliable/broker")
    else:
        raise click.BadParameter(f"{url!r} is not a reliable://, unix:// or embedded:// broker URL", param_hint="--url")
    try:
        yield api
    finally:
        api.close()


def _show(rows: Sequence[Any], as_json: bool) -> None:
    records = [dataclasses.asdict(row) for row in rows]
    if as_json:
        for record in records:
            click.echo(json.dumps(record, default=list))
        return
    show_table(records)


def _inspect(func: Any) -> Any:
    func = click.option("--json", "as_json", is_flag=True, help="JSON lines instead of a table")(func)
    func = click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)(func)
    return click.option("--url", help="reliable://host:port or embedded://DIR (default: [transport] url)")(func)


@broker.command()
@_inspect
def topics(url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Every topic with its queues, messages kept and the bytes they take."""
    with _api(url, settings_path) as api:
        _show(api.topics(), as_json)


@broker.command()
@_inspect
def groups(url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Every consumer group: its topics and live members."""
    with _api(url, settings_path) as api:
        _show(api.groups(), as_json)


@broker.command()
@click.argument("group")
@_inspect
def lag(group: str, url: str | None, settings_path: str | None, as_json: bool) -> None:
    """GROUP's committed offset against the end of every queue it reads."""
    with _api(url, settings_path) as api:
        rows = [dataclasses.replace(q) for q in api.lag(group)]
        if not rows:  # a misspelt group would otherwise pass for one with nothing to read
            known = sorted(g.name for g in api.groups() if g.name != group)
            click.echo(f"no group {group!r} on this broker" + (f"; groups: {', '.join(known)}" if known else ""),
                       err=True)
        _show(rows, as_json)


class _EmbeddedAdmin:
    """The operator calls a `broker.client.Client` has, over an embedded directory's engine."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def dlq_waiting(self, group: str) -> int:
        from broker.delivery import lookup

        return lookup.dlq_waiting(self.api, group)

    def lookup_key(self, topic: str, key: str, begin: float, end: float, limit: int) -> list[Any]:
        from broker.delivery import lookup

        return lookup.by_key(self.api.engine, topic, key, begin, end, limit)

    def lookup_id(self, message_id: str) -> Any:
        from broker.delivery import lookup

        return lookup.by_id(self.api.engine, message_id)

    def stats(self) -> dict[str, float]:
        topics = [t for t in self.api.topics() if not t.name.startswith("%")]
        groups = self.api.groups()
        return {"topics": len(topics), "messages": sum(t.messages for t in topics),
                "groups": len(groups), "members": sum(g.members for g in groups)}


@contextmanager
def _admin(url: str | None, settings_path: str | None) -> Iterator[Any]:
    with _api(url, settings_path) as api:
        yield api if hasattr(api, "stats") else _EmbeddedAdmin(api)


@broker.command()
@_inspect
def stats(url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Topics, messages, groups, members; on a server also its counters since it started."""
    with _admin(url, settings_path) as api:
        values = api.stats()
    if as_json:
        click.echo(json.dumps(values, sort_keys=True))
        return
    show_table([{"name": name, "value": f"{value:g}"} for name, value in sorted(values.items())])


@broker.group()
def dlq() -> None:
    """A group's dead-letter queue %DLQ%<group> in the broker: list, replay, purge.

    For programs that use the broker directly (its clients, STOMP). A handler
    of the framework keeps its dead letters in its store instead: list and
    replay those with `reliable dlq` (the broker holds no copy of them).
    """


@dlq.command("list")
@click.argument("group")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
              help="at most this many, oldest first")
@_inspect
def dlq_list(group: str, limit: int, url: str | None, settings_path: str | None, as_json: bool) -> None:
    """GROUP's dead letters not yet replayed or purged, with their cause."""
    with _admin(url, settings_path) as api:
        _show_messages(api.dlq_list(group, limit), as_json)


OFFSETS_HELP = "only the letter at this offset of %DLQ%<group> (`dlq list` shows it); repeatable"


@dlq.command("replay")
@click.argument("group")
@click.option("--offset", "offsets", type=int, multiple=True, help=OFFSETS_HELP)
@_inspect
def dlq_replay(group: str, offsets: tuple[int, ...], url: str | None, settings_path: str | None,
               as_json: bool) -> None:
    """Send GROUP's dead letters (or those at --offset) back to GROUP only (a progress bar in a terminal)."""
    if offsets:
        with _admin(url, settings_path) as api:
            replayed = api.dlq_replay_letters(group, list(offsets))
        click.echo(json.dumps({"group": group, "replayed": replayed}) if as_json
                   else f"replayed {replayed} dead letter(s) to {group}")
        return
    with _admin(url, settings_path) as api:
        total = api.dlq_waiting(group)
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def replay() -> None:
            try:
                outcome["replayed"] = api.dlq_replay(group)
            except Exception as exc:  # reported below, on the command's thread
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=replay, name="dlq-replay", daemon=True).start()
        with progress_bar(total, f"replaying %DLQ%{group}") as bar:
            while not done.wait(0.2):
                bar.update(bar.task_ids[0], completed=max(0, total - api.dlq_waiting(group)))
    if "error" in outcome:
        raise click.ClickException(str(outcome["error"]))
    click.echo(json.dumps({"group": group, "replayed": outcome["replayed"]}) if as_json
               else f"replayed {outcome['replayed']} dead letter(s) to {group}")


@dlq.command("purge")
@click.argument("group")
@click.option("--offset", "offsets", type=int, multiple=True, help=OFFSETS_HELP)
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@_inspect
def dlq_purge(group: str, offsets: tuple[int, ...], yes: bool, url: str | None, settings_path: str | None,
              as_json: bool) -> None:
    """Drop GROUP's dead letters, or those at --offset (they stay in the log until retention removes them)."""
    if not yes:
        chosen = f"the dead letters of {group} at offsets {list(offsets)}" if offsets else f"every dead letter of {group}"
        click.confirm(f"purge {chosen}?", abort=True)
    with _admin(url, settings_path) as api:
        purged = api.dlq_purge_letters(group, list(offsets)) if offsets else api.dlq_purge(group)
    click.echo(json.dumps({"group": group, "purged": purged}) if as_json
               else f"purged {purged} dead letter(s) of {group}")


@broker.command()
@click.argument("topic", required=False)
@click.option("--key", help="the messages of TOPIC with this key (the store's key index)")
@click.option("--since", default="0", show_default=True, help="stored at or after: ISO time or epoch seconds")
@click.option("--until", default=None, help="stored at or before (default: now)")
@click.option("--id", "message_id", help="the message with this id (TOPIC not needed)")
@click.option("--limit", type=click.IntRange(min=1), default=64, show_default=True)
@_inspect
def message(topic: str | None, key: str | None, since: str, until: str | None, message_id: str | None,
            limit: int, url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Look messages up: by --id, or by TOPIC and --key within --since / --until."""
    if bool(message_id) == bool(key):
        raise click.UsageError("give either --id ID, or TOPIC with --key KEY")
    if key and not topic:
        raise click.UsageError("--key needs the TOPIC argument")
    with _admin(url, settings_path) as api:
        if message_id:
            found = api.lookup_id(message_id)
            rows = [found] if found is not None else []
        else:
            end = _moment(until, "--until") if until else datetime.now(UTC).timestamp()
            rows = api.lookup_key(topic, key, _moment(since, "--since"), end, limit)
    _show_messages(rows, as_json)


def _moment(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither epoch seconds nor an ISO time", param_hint=option) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _show_messages(rows: Sequence[Any], as_json: bool) -> None:
    from broker.delivery.values import as_dict

    if as_json:
        for row in rows:
            record = {k: v for k, v in as_dict(row).items() if k not in ("receipt", "body")}
            record["headers"] = dict(row.headers)
            try:
                record["body"] = row.body.decode()
            except UnicodeDecodeError:
                record["body_base64"] = base64.b64encode(row.body).decode()
            click.echo(json.dumps(record, default=list))
        return
    _show([_MessageRow(r.topic, r.queue, r.offset, r.message_id, r.key,
                       datetime.fromtimestamp(r.published_at, UTC).isoformat(timespec="seconds"),
                       r.headers.get("x-dlq-cause", "")[:40], _preview(r.body)) for r in rows], False)


def _preview(body: bytes) -> str:
    text = body.decode(errors="replace")
    return text if len(text) <= 40 else text[:39] + "…"


@dataclasses.dataclass(frozen=True)
class _MessageRow:
    topic: str
    queue: int
    offset: int
    message_id: str
    key: str
    stored: str
    cause: str
    body: str
