"""structlog configuration (JSON / console, level filtering) and the counters."""

from __future__ import annotations

import io
import json
import threading

import pytest
import structlog
from structlog.testing import capture_logs

from backends.errors import ConfigurationError
from reliable import log as reliable_log
from reliable.log import COUNTERS, Counters, configure_logging, get_logger


@pytest.fixture(autouse=True)
def restore_structlog():
    yield
    structlog.reset_defaults()
    reliable_log._configured = None


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_when_not_a_terminal():
    out = io.StringIO()
    configure_logging("info", "auto", stream=out)
    get_logger("reliable.test").info("dead_lettered", group="billing", attempt=7)
    record = json.loads(out.getvalue())
    assert record["event"] == "dead_lettered"
    assert record["group"] == "billing" and record["attempt"] == 7
    assert record["level"] == "info" and record["logger"] == "reliable.test"
    assert record["timestamp"].endswith("Z") and "T" in record["timestamp"]


def test_console_in_a_terminal_and_json_when_asked():
    terminal = Terminal()
    configure_logging("info", "auto", stream=terminal)
    get_logger("t").info("duplicate_skipped", token="abc")
    assert "duplicate_skipped" in terminal.getvalue()
    with pytest.raises(json.JSONDecodeError):
        json.loads(terminal.getvalue())
    forced = Terminal()
    configure_logging("info", "json", stream=forced)
    get_logger("t").info("duplicate_skipped")
    assert json.loads(forced.getvalue())["event"] == "duplicate_skipped"


def test_exceptions_render_as_structured_tracebacks():
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    try:
        raise ValueError("bad body")
    except ValueError:
        get_logger("t").exception("handler_failed")
    record = json.loads(out.getvalue())
    assert record["exception"][0]["exc_type"] == "ValueError"


def test_level_filtering():
    configure_logging("warning", "json", stream=io.StringIO())
    with capture_logs() as logs:
        logger = get_logger("t")
        logger.info("message_processed")
        logger.warning("redelivery_scheduled", delay=5.0)
    assert [entry["event"] for entry in logs] == ["redelivery_scheduled"]
    assert logs[0]["log_level"] == "warning" and logs[0]["logger"] == "t"


def test_configure_is_idempotent():
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    configure_logging("info", "json", stream=out)
    get_logger("t").info("once")
    assert out.getvalue().count("once") == 1


@pytest.mark.parametrize(("level", "fmt", "match"), [("loud", "json", "log level 'loud'"), ("info", "xml", "log format 'xml'")])
def test_bad_level_or_format(level, fmt, match):
    with pytest.raises(ConfigurationError, match=match):
        configure_logging(level, fmt)


def test_counters_are_thread_safe():
    counters = Counters()
    assert counters.snapshot() == dict.fromkeys(COUNTERS, 0)

    def work() -> None:
        for _ in range(1000):
            counters.incr("processed")
        counters.incr("custom", 2)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snapshot = counters.snapshot()
    assert snapshot["processed"] == 8000 and snapshot["custom"] == 16
    assert counters.get("dead_lettered") == 0 and counters.get("unknown") == 0
    snapshot["processed"] = 0
    assert counters.get("processed") == 8000  # a snapshot is a copy
    with pytest.raises(ValueError):
        counters.incr("processed", -1)
