"""Fixtures of the contract suites: every backend of a protocol behind one fixture.

``store`` runs over SQLite (a file in tmp_path) and the real PostgreSQL;
``cache`` over memory and the real Redis. Both use a `FakeClock` where the
backend keeps time itself (the store always; the memory cache).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from backends.cache import Cache, open_cache
from backends.clock import FakeClock
from backends.store import Store, open_store


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, sqlite_url: str) -> str:
    if request.param == "sqlite":
        return sqlite_url
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def store(store_url: str, fake_clock: FakeClock) -> Iterator[Store]:
    opened = open_store(store_url, clock=fake_clock)
    yield opened
    opened.close()


@pytest.fixture(params=["memory", "redis"])
def cache_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://?max_entries=1000"
    return request.getfixturevalue("redis_url")


@pytest.fixture
def cache(cache_url: str, fake_clock: FakeClock) -> Iterator[Cache]:
    opened = open_cache(cache_url, clock=fake_clock)
    yield opened
    opened.close()
