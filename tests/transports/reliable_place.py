"""How the shared suites open ``reliable://``: one broker server process for the test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.broker.server.serving import ServerProcess


@pytest.fixture(scope="session")
def reliable_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Every client of the worker's tests comes from 127.0.0.1, as through a load balancer: that
    address gets ``max_connections`` whole, as it had before the per-address cap (128)."""
    folder = tmp_path_factory.mktemp("reliable-server")
    settings = folder / "reliable.toml"
    settings.write_text('[broker]\nmax_connections_per_address_overrides = { "127.0.0.1" = 1024 }\n')
    server = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield server
    server.stop()


def reliable(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> tuple[str, dict[str, Any]]:
    """The contract suite's place on ``reliable://``: topics and groups are fresh per test."""
    return request.getfixturevalue("reliable_server").url, {}
