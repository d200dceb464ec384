"""The probes on the metrics port: /healthz, /readyz (503 while PostgreSQL is cut), /metrics, 404."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from reliable import App, Message
from reliable.health import serve_probes
from reliable.testing import test_app


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def eventually(check: Callable[[], bool], what: str, seconds: float = 60) -> None:
    """Wait until ``check()`` holds (asked again every 50 ms)."""
    pause = threading.Event()
    for _ in range(int(seconds / 0.05)):
        if check():
            return
        pause.wait(0.05)
    raise AssertionError(f"never: {what}")


def test_readyz_is_503_while_postgresql_is_cut_and_200_once_it_is_back(tmp_path, postgres_url, postgres_proxy, unique) -> None:
    parts = urlsplit(postgres_url)
    through_proxy = urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{postgres_proxy.port}"))
    app = test_app(tmp_path, store=through_proxy, cache="none",
                   settings={"RELIABLE_WORKER__POLL_TIMEOUT": "0.05"})

    @app.handler("orders", group=unique)
    def handle(msg: Message, tx) -> None:
        pass

    server = serve_probes(app, 0)
    port = server.server_address[1]
    assert get(port, "/healthz")[0] == 503  # not running yet
    worker = threading.Thread(target=app.run)
    worker.start()
    try:
        eventually(lambda: get(port, "/readyz")[0] == 200, "ready")
        assert get(port, "/healthz")[0] == 200
        postgres_proxy.cut()
        status, body = get(port, "/readyz")
        assert status == 503 and '"store": false' in body
        assert get(port, "/healthz")[0] == 200  # alive: a store outage is not a reason to restart
        postgres_proxy.restore()
        eventually(lambda: get(port, "/readyz")[0] == 200, "ready again")
        status, metrics = get(port, "/metrics")
        assert status == 200 and "reliable_messages_total" in metrics
        assert get(port, "/nope")[0] == 404
    finally:
        app.stop()
        worker.join()
        server.shutdown()
        app.close()
    assert get_after_stop(app) == 503


def get_after_stop(app: App) -> int:
    server = serve_probes(app, 0)
    try:
        return get(server.server_address[1], "/healthz")[0]
    finally:
        server.shutdown()
