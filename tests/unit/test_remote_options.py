"""``reliable://`` options read from the URL, and a bad one named (no server needed: nothing connects)."""

from __future__ import annotations

import pytest

from backends.errors import ConfigurationError
from backends.transport import open_transport


@pytest.mark.parametrize(("query", "error"), [("publish_retry=-1", "publish_retry=-1.0"),
                                              ("publish_retry=soon", "option publish_retry='soon'")])
def test_a_bad_publish_retry_is_named(query: str, error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        open_transport(f"reliable://127.0.0.1:1?{query}")
