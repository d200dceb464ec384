"""How the shared suites open `amqp://`: the real RabbitMQ server, a fresh namespace per test.

For the contract suite (`tests/contract/transports.py`)::

    from tests.transports.amqp_place import amqp
    TRANSPORTS = {..., "amqp": amqp}

The suite's transport fixture calls ``purge()``, which deletes the test's queues and exchanges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def amqp(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> tuple[str, dict[str, Any]]:
    """The contract suite's place on `amqp://`: queues and exchanges under the test's namespace."""
    return request.getfixturevalue("amqp_url"), {"namespace": unique}
