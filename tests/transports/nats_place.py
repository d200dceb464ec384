"""How the shared suites open `nats://`: the real JetStream server, a fresh namespace per test.

For the contract suite (`tests/contract/transports.py`)::

    from tests.transports.nats_place import nats
    TRANSPORTS = {..., "nats": nats}

The suite's transport fixture calls ``purge()``, which deletes the test's streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def nats(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> tuple[str, dict[str, Any]]:
    """The contract suite's place on `nats://`: streams and consumers under the test's namespace."""
    return request.getfixturevalue("nats_url"), {"namespace": unique}
