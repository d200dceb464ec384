"""`backends.urls.redact`: the one redactor of backend URLs."""

from __future__ import annotations

import pytest

from backends.urls import redact


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:secret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("postgresql+psycopg://app:p%40ss@db/orders", "postgresql+psycopg://app:***@db/orders"),
        ("amqp://guest:guest@localhost:5672/", "amqp://guest:***@localhost:5672/"),
        ("sqlite:///./.reliable/reliable.db", "sqlite:///./.reliable/reliable.db"),
        ("memory://?max_entries=10", "memory://?max_entries=10"),
        ("not a url", "not a url"),
        ("http://user:secret@[::1", "http://***"),
    ],
)
def test_redact_hides_the_password_only(url: str, shown: str) -> None:
    assert redact(url) == shown
