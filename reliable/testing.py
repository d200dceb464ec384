"""Helpers for testing handlers: a fake clock, an in-memory app, a dead-letter view.

```python
from reliable.testing import FakeClock, test_app
app = test_app(tmp_path)              # memory transport, SQLite in tmp_path, memory cache
@app.handler("orders", token="body.id")
def handle(msg, tx): ...
app.publish("orders", {"id": 1})
app.run(until_idle=True)              # redelivery delays pass on the fake clock, instantly
assert app.stats()["processed"] == 1
```
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

from backends.clock import Clock, FakeClock
from backends.types import Message
from reliable.app import App
from reliable.settings import Settings

__all__ = ["FakeClock", "dead_letter_queue", "test_app"]


def test_app(
    directory: str | Path | None = None,
    *,
    clock: Clock | None = None,
    store: str | None = None,
    cache: str = "memory://",
    transport: str = "memory://",
    settings: Mapping[str, str] | None = None,
) -> App:
    """An app on the in-memory transport and cache, a SQLite store in ``directory``, a fake clock.

    ``settings`` are extra overrides in environment form
    (``{"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"}``).
    """
    folder = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="reliable-test-"))
    env = {
        "RELIABLE_STORE__URL": store or f"sqlite:///{folder / 'store.db'}",
        "RELIABLE_CACHE__URL": cache,
        "RELIABLE_TRANSPORT__URL": transport,
        **(settings or {}),
    }
    return App(Settings.load(None, env=env), clock=clock if clock is not None else FakeClock())


test_app.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def dead_letter_queue(app: App, group: str) -> list[Message]:
    """The messages the transport moved to ``%DLQ%<group>`` (memory transport)."""
    transport = app.transport
    if not hasattr(transport, "dead_letter_queue"):
        raise TypeError(f"{type(transport).__name__} does not expose its dead-letter queue")
    return list(transport.dead_letter_queue(group))
