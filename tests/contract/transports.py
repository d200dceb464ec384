"""Every transport the contract suite runs on: a name and how to open one for a test.

A transport joins the suite by adding one entry to `TRANSPORTS`: a function of
the pytest request, a temporary directory and a unique name that returns the
URL (and options) of a fresh, isolated place on that transport.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.transports.amqp_place import amqp
from tests.transports.kafka_place import kafka
from tests.transports.nats_place import nats
from tests.transports.reliable_place import reliable

Place = tuple[str, dict[str, Any]]
"""A transport URL and the options `open_transport` gets for it."""


def memory(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Place:
    return "memory://", {}


def embedded(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Place:
    return f"embedded://{tmp_path / 'broker'}", {}


def redis(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Place:
    return f"{request.getfixturevalue('redis_url')}?namespace={unique}", {}


TRANSPORTS: dict[str, Callable[[pytest.FixtureRequest, Path, str], Place]] = {
    "memory": memory,
    "embedded": embedded,
    "redis": redis,
    "kafka": kafka,
    "nats": nats,
    "amqp": amqp,
    "reliable": reliable,
}

LEASING = ("memory", "redis")
"""Transports whose leases and delays follow an injected clock (their own suite too)."""
