"""``reliable console``: the web console for a deployment, served until Ctrl-C / SIGTERM."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from broker.console.config import ConsoleConfig, require_console_packages
from broker.errors import BrokerConfigError
from reliable.cli_output import listening

SETTINGS_HELP = "settings file (default: $RELIABLE_SETTINGS, else ./reliable.toml if present)"


@click.command()
@click.option("--settings", "settings_path", type=click.Path(dir_okay=False), help=SETTINGS_HELP)
@click.option("--host", help="address to bind (default: [broker] console_host, else 127.0.0.1)")
@click.option("--port", type=int, help="port (default: [broker] console_port, else 8700; 0: any free port)")
@click.option("--metrics", "metrics", multiple=True, metavar="URL",
              help="a worker's /metrics URL (`reliable run --metrics-port`), for the handlers' counters (repeatable)")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="serve 127.0.0.1:PORT/metrics (Prometheus): the connections the console refused")
def console(settings_path: str | None, host: str | None, port: int | None, metrics: tuple[str, ...],
            metrics_port: int | None) -> None:
    """Serve the web console: topics, groups, lag and dead letters, with replay and purge.

    Users log in with the [broker.users] of the settings file, with the rights
    they have on the broker; with no users the console is open and binds
    loopback only.
    """
    require_console_packages()
    from broker.server.config import ServerConfig
    from broker.server.run import settings_table
    from reliable.app import App
    from reliable.console import serve
    from reliable.log import configure_logging
    from reliable.settings import Settings

    configure_logging("info")
    table = settings_table(settings_path or _default_path())
    given = {k: v for k, v in {"console_host": host, "console_port": port}.items() if v is not None}
    server_keys = {k: v for k, v in table.items() if k in ("users", "users_file", "host")}
    try:
        users = ServerConfig.from_mapping(server_keys).authenticator()
        config = ConsoleConfig.from_mapping({"console_port": 8700, **_console_keys(table), **given},
                                            table.get("host", "127.0.0.1"))
    except BrokerConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    assert config is not None
    app = App(Settings.load(settings_path))
    server = serve(app, config, users, metrics)
    if metrics_port is not None:
        from reliable.metrics import serve_metrics

        registry = server.metrics.registry
        listening("--metrics-port", "127.0.0.1", metrics_port, lambda: serve_metrics(metrics_port, registry=registry),
                  "/metrics")
    click.echo(f"console on {server.url} (Ctrl-C to stop)")
    _wait_for_signal()
    server.stop()
    app.close()


def _console_keys(table: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in table.items() if k.startswith("console_")}


def _default_path() -> str | None:
    import os
    from pathlib import Path

    path = os.environ.get("RELIABLE_SETTINGS") or ("reliable.toml" if Path("reliable.toml").exists() else None)
    return path


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
