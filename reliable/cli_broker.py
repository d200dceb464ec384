"""``reliable broker ...``: serve the broker, and look into one (topics, groups, lag).

``serve`` runs the broker server of the ``[broker]`` table of the settings
file. The other commands reach a broker by URL: ``--url reliable://host:port``
(a server) or ``--url embedded://DIR`` (a directory: its owner's socket, or
the directory itself when no process owns it); without ``--url``, the
settings' transport URL. Tables in a terminal, JSON lines with ``--json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from reliable.log import configure_logging
from reliable.settings import Settings

SETTINGS_HELP = "settings file (default: $RELIABLE_SETTINGS, else ./reliable.toml if present)"


@click.group()
def broker() -> None:
    """The project's broker: serve it, inspect it."""


@broker.command()
@click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)
@click.option("--data-dir", help="the store's directory (default: [broker] data_dir)")
@click.option("--host", help="address to bind (default 127.0.0.1)")
@click.option("--port", type=int, help="native protocol port (default 7600)")
def serve(settings_path: str | None, data_dir: str | None, host: str | None, port: int | None) -> None:
    """Serve the broker over TCP until SIGTERM / Ctrl-C (graceful: offsets and checkpoint written)."""
    from broker.server.run import run, settings_table

    configure_logging("info")
    run(settings_table(settings_path), data_dir=data_dir, host=host, port=port)


@contextmanager
def _api(url: str | None, settings_path: str | None) -> Iterator[Any]:
    configure_logging("warning")  # the output is the table (or JSON); logs go to stderr
    url = url or Settings.load(settings_path).transport.url
    scheme, _, rest = url.partition("://")
    if scheme == "reliable":
        from broker.client import Client

        api: Any = Client(url)
    elif scheme == "embedded":
        from broker.embedded import open_embedded

        api = open_embedded(rest.partition("?")[0] or ".reliable/broker")
    else:
        raise click.BadParameter(f"{url!r} is not a reliable:// or embedded:// broker URL", param_hint="--url")
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
    if not records:
        click.echo("(none)")
        return
    columns = list(records[0])
    widths = [max(len(c), *(len(str(r[c])) for r in records)) for c in columns]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for record in records:
        click.echo("  ".join(str(record[c]).ljust(w) for c, w in zip(columns, widths)))


def _inspect(func: Any) -> Any:
    func = click.option("--json", "as_json", is_flag=True, help="JSON lines instead of a table")(func)
    func = click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)(func)
    return click.option("--url", help="reliable://host:port or embedded://DIR (default: [transport] url)")(func)


@broker.command()
@_inspect
def topics(url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Every topic with its queues and messages kept."""
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
        _show([dataclasses.replace(q) for q in api.lag(group)], as_json)


@broker.group("dlq")
def broker_dlq() -> None:
    """The broker's dead-letter queues (%DLQ%<group>)."""


@broker_dlq.command("list")
@click.argument("group")
@click.option("--limit", default=100, show_default=True)
@_inspect
def dlq_list(group: str, limit: int, url: str | None, settings_path: str | None, as_json: bool) -> None:
    """GROUP's dead letters, oldest first, with their cause."""
    with _api(url, settings_path) as api:
        _show([_letter(d) for d in api.dlq_list(group, limit)], as_json)


@broker_dlq.command("replay")
@click.argument("group")
@_inspect
def dlq_replay(group: str, url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Every dead letter of GROUP back to GROUP only; the queue is emptied."""
    with _api(url, settings_path) as api:
        count = api.dlq_replay(group)
        click.echo(json.dumps({"replayed": count}) if as_json else f"replayed {count} dead letter(s) of {group}")


@broker_dlq.command("purge")
@click.argument("group")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@_inspect
def dlq_purge(group: str, yes: bool, url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Delete GROUP's dead letters from the broker's queue."""
    if not yes:
        click.confirm(f"purge every dead letter of {group}?", abort=True)
    with _api(url, settings_path) as api:
        count = api.dlq_purge(group)
        click.echo(json.dumps({"purged": count}) if as_json else f"purged {count} dead letter(s) of {group}")


@broker.command()
@click.argument("topic")
@click.option("--key", help="messages with this key (the store's key index)")
@click.option("--id", "message_id", help="the message with this id")
@click.option("--since", type=float, default=0.0, help="seconds since the epoch (with --key)")
@click.option("--until", type=float, default=1e18, help="seconds since the epoch (with --key)")
@_inspect
def find(topic: str, key: str | None, message_id: str | None, since: float, until: float,
         url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Messages of TOPIC by key within a time range, or one by id."""
    if not key and not message_id:
        raise click.UsageError("give --key or --id")
    with _api(url, settings_path) as api:
        _show([_letter(d) for d in api.lookup(topic, key, message_id, since, until)], as_json)


@broker.command()
@_inspect
def stats(url: str | None, settings_path: str | None, as_json: bool) -> None:
    """Topics, messages kept, groups and their total lag."""
    with _api(url, settings_path) as api:
        rows = [Stat(g.name, ",".join(g.topics), g.members, sum(q.lag for q in api.lag(g.name)))
                for g in api.groups()]
        if not as_json:
            kept = sum(t.messages for t in api.topics())
            click.echo(f"{len(api.topics())} topic(s), {kept} message(s) kept, {len(rows)} group(s)")
        _show(rows, as_json)


@dataclasses.dataclass(frozen=True)
class Stat:
    group: str
    topics: str
    members: int
    lag: int


@dataclasses.dataclass(frozen=True)
class Letter:
    topic: str
    queue: int
    offset: int
    message_id: str
    key: str
    body: str
    cause: str


def _letter(d: Any) -> Letter:
    body = d.body.decode("utf-8", "replace")
    return Letter(d.topic, d.queue, d.offset, d.message_id, d.key, body[:200],
                  d.headers.get("x-dlq-cause", ""))
