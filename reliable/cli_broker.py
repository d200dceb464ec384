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
