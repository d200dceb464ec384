"""Decorator options are checked when the decorator runs, naming the culprit."""

from __future__ import annotations

import pytest

from reliable.errors import ConfigurationError
from reliable.spark import foreach_batch

pytestmark = pytest.mark.spark


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"token": "id", "colour": "blue"}, "unknown option.*colour"),
        ({"token": ""}, "token=''"),
        ({"token": "id", "validate": lambda row: row}, "need dead_letters"),
        ({"token": "id", "on_retries_spent": "ignore"}, "on_retries_spent='ignore'"),
        ({"token": "id", "dead_letters": "drop table;"}, "dead_letters='drop table;'"),
        ({"token": "id", "retry": 3}, "retry=3"),
        ({"token": "id", "cache": "yes"}, "cache=.yes. is not allowed; expected True or False"),
        ({"token": "id", "sink": "kafka"}, "sink='kafka' is not allowed; expected 'any' or 'store'"),
    ],
)
def test_bad_options_are_refused_at_decoration_time(options, message):
    with pytest.raises(ConfigurationError, match=message):
        foreach_batch(object(), name="orders-sink", **options)
