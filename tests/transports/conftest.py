"""Fixtures of the transport suites."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text


@pytest.fixture
def effects(postgres_url: str, unique: str) -> Iterator[str]:
    """A table of the test's own in which its handlers write each token (their side effect); dropped afterwards."""
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null)"))
    yield unique
    with engine.begin() as conn:
        conn.execute(text(f"drop table if exists {unique}"))
    engine.dispose()
