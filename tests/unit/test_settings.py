"""The settings file: defaults, file values, environment and per-handler overrides, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliable.retry import DelayLevels, InProcessRetry, RedeliveryPolicy
from reliable.settings import Settings, SettingsError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "reliable.toml"
    path.write_text(text)
    return path


def load_error(path: Path | None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(SettingsError) as info:
        Settings.load(path, env=env or {})
    return str(info.value)


def test_defaults_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings.load(env={})
    assert settings.transport.url == "embedded://./.reliable/broker"
    assert settings.transport.visibility_timeout == 30.0
    assert settings.cache.url == "memory://" and settings.cache.ttl == 86400
    assert settings.store.url == "sqlite:///./.reliable/reliable.db"
    assert settings.store.token_ttl == 7 * 86400
    assert settings.commit.strategy == "per_message" and settings.commit.batch_size == 100
    assert (settings.worker.concurrency, settings.worker.prefetch) == (1, 100)
    assert (settings.log.level, settings.log.format) == ("info", "auto")
    assert (settings.broker.host, settings.broker.port) == ("127.0.0.1", 7600)
    assert settings.retry.policy() == RedeliveryPolicy()
    assert settings.retry.in_process() == InProcessRetry()


def test_file_values(tmp_path):
    path = write(tmp_path, """
[store]
url = "postgresql+psycopg://postgres@127.0.0.1/test"
token_ttl = "2d"

[retry]
initial_delay = "500ms"
multiplier = 2
max_delay = "1m"
jitter = 0.1
max_redeliveries = 4
in_process_attempts = 5
in_process_max_wait = 0.5

[commit]
strategy = "batch"
batch_size = 50
interval = "2s"

[log]
level = "DEBUG"
format = "json"
""")
    settings = Settings.load(path, env={})
    assert settings.store.url.startswith("postgresql+psycopg://") and settings.store.token_ttl == 172800
    assert settings.retry.policy() == RedeliveryPolicy(
        initial_delay=0.5, multiplier=2.0, max_delay=60.0, jitter=0.1, max_redeliveries=4
    )
    assert settings.retry.in_process() == InProcessRetry(attempts=5, max_wait=0.5)
    assert (settings.commit.strategy, settings.commit.batch_size, settings.commit.interval) == ("batch", 50, 2.0)
    assert (settings.log.level, settings.log.format) == ("debug", "json")


def test_file_found_through_variable_or_working_directory(tmp_path, monkeypatch):
    path = write(tmp_path, "[worker]\nconcurrency = 4\n")
    assert Settings.load(env={"RELIABLE_SETTINGS": str(path)}).worker.concurrency == 4
    monkeypatch.chdir(tmp_path)
    assert Settings.load(env={}).worker.concurrency == 4
    assert "missing.toml: settings file not found" in load_error(tmp_path / "missing.toml")


def test_delay_levels_select_rocketmq_policy(tmp_path):
    path = write(tmp_path, '[retry]\ndelay_levels = ["1s", "10s", "1m"]\n')
    policy = Settings.load(path, env={}).retry.policy()
    assert policy == DelayLevels(levels=(1.0, 10.0, 60.0), start_level=1, max_redeliveries=16)


def test_environment_beats_file(tmp_path):
    path = write(tmp_path, '[store]\nurl = "sqlite:///a.db"\n[retry]\nmax_redeliveries = 2\n')
    env = {
        "RELIABLE_STORE__URL": "sqlite:///b.db",
        "RELIABLE_RETRY__MAX_REDELIVERIES": "7",
        "RELIABLE_RETRY__DELAY_LEVELS": '["5s", "1m"]',
    }
    settings = Settings.load(path, env=env)
    assert settings.store.url == "sqlite:///b.db"
    assert settings.retry.max_redeliveries == 7
    assert settings.retry.delay_levels == [5.0, 60.0]


def test_per_handler_overrides(tmp_path):
    path = write(tmp_path, """
[retry]
max_redeliveries = 6
jitter = 0.2

[handlers.charge.retry]
max_redeliveries = 3

[handlers.charge.commit]
strategy = "transactional"
""")
    env = {"RELIABLE_HANDLERS__CHARGE__WORKER__CONCURRENCY": "8"}
    settings = Settings.load(path, env=env)
    charge = settings.for_handler("charge")
    assert charge.retry.max_redeliveries == 3 and charge.retry.jitter == 0.2
    assert charge.commit.strategy == "transactional" and charge.worker.concurrency == 8
    assert charge.handlers == {}
    other = settings.for_handler("ship")
    assert other.retry.max_redeliveries == 6 and other.commit.strategy == "per_message"


def test_unknown_key_is_an_error(tmp_path):
    message = load_error(write(tmp_path, "[retry]\nmax_redelivery = 3\n"))
    assert "reliable.toml: unknown key retry.max_redelivery" in message
    assert "did you mean 'max_redeliveries'?" in message
    assert "unknown key retyr" in load_error(write(tmp_path, "[retyr]\n"))
    env_message = load_error(None, {"RELIABLE_STORE__UTL": "x"})
    assert env_message.startswith("environment variable RELIABLE_STORE__UTL: unknown key store.utl")


def test_bad_enum_names_file_key_value_and_choices(tmp_path):
    message = load_error(write(tmp_path, '[commit]\nstrategy = "sometimes"\n'))
    assert message == (
        f"{tmp_path / 'reliable.toml'}: commit.strategy = 'sometimes' is not allowed; "
        "expected one of per_message, batch, async, transactional"
    )


def test_bad_types_and_ranges(tmp_path):
    path = write(tmp_path, """
[retry]
max_redeliveries = "many"
jitter = 1.5
multiplier = true

[worker]
concurrency = 1.5

[cache]
ttl = "soon"
""")
    message = load_error(path)
    assert "retry.max_redeliveries = 'many' is not allowed; expected an integer" in message
    assert "retry.jitter = 1.5 is not allowed; expected a fraction >= 0 and < 1" in message
    assert "retry.multiplier = true is not allowed; expected a number >= 1" in message
    assert "worker.concurrency = 1.5 is not allowed; expected an integer" in message
    assert "cache.ttl = 'soon' is not allowed; expected a duration > 0 (seconds, or" in message


def test_bad_handler_override_and_env_value_are_named(tmp_path):
    path = write(tmp_path, "[handlers.charge.retry]\nmax_redeliveries = -5\n")
    assert "handlers.charge.retry.max_redeliveries = -5 is not allowed; expected an integer >= 0, or -1" in (
        load_error(path)
    )
    env = {"RELIABLE_HANDLERS__CHARGE__RETRY__DELAY_LEVELS": '["1s", "2q"]'}
    message = load_error(None, env)
    assert message.startswith("environment variable RELIABLE_HANDLERS__CHARGE__RETRY__DELAY_LEVELS: ")
    assert "handlers.charge.retry.delay_levels[1] = '2q' is not allowed" in message
    assert "do not nest" in load_error(write(tmp_path, "[handlers.a.handlers.b]\n"))


def test_toml_syntax_error_names_file_and_line(tmp_path):
    message = load_error(write(tmp_path, '[store]\nurl = "sqlite:///x.db"\nretry = \n'))
    assert message.startswith(f"{tmp_path / 'reliable.toml'}: invalid TOML at line 3")


def test_handler_can_switch_back_from_delay_levels(tmp_path):
    path = write(tmp_path, '[retry]\ndelay_levels = ["1s", "1m"]\n[handlers.fast.retry]\ndelay_levels = []\n')
    settings = Settings.load(path, env={})
    assert isinstance(settings.retry.policy(), DelayLevels)
    assert settings.for_handler("fast").retry.policy() == RedeliveryPolicy()


@pytest.mark.parametrize(
    ("section", "url", "allowed"),
    [
        ("transport", "rabbit://localhost", "expected a transport URL with scheme memory://, embedded://"),
        ("store", "mongodb://localhost/x", "expected a store URL with scheme sqlite://, postgresql://"),
        ("cache", "memcached://localhost", "expected a cache URL with scheme memory://, redis://"),
    ],
)
def test_unknown_url_schemes_name_file_key_value_and_schemes(tmp_path, section, url, allowed):
    message = load_error(write(tmp_path, f'[{section}]\nurl = "{url}"\n'))
    assert message.startswith(f"{tmp_path / 'reliable.toml'}: {section}.url = '{url}' is not allowed; ")
    assert allowed in message
    env_message = load_error(None, {f"RELIABLE_{section.upper()}__URL": url})
    assert env_message.startswith(f"environment variable RELIABLE_{section.upper()}__URL") and allowed in env_message


def test_a_cache_ttl_longer_than_the_token_ttl_is_refused(tmp_path):
    path = tmp_path / "reliable.toml"
    path.write_text('[cache]\nttl = "30d"\n[store]\ntoken_ttl = "7d"\n')
    with pytest.raises(SettingsError, match=r"reliable.toml: cache.ttl = 2592000s is longer than store.token_ttl = 604800s"):
        Settings.load(path, env={})


def test_a_reliable_variable_naming_no_setting_is_reported_with_the_closest_name():
    with pytest.raises(SettingsError, match="RELIABLE_STOR__URL names no setting.*did you mean RELIABLE_STORE__URL"):
        Settings.load(None, env={"RELIABLE_STOR__URL": "sqlite:///x.db"})
    with pytest.raises(SettingsError, match="did you mean RELIABLE_LOG__LEVEL"):
        Settings.load(None, env={"RELIABLE_LOG_LEVEL": "debug"})


def test_cache_prefix_is_checked():
    assert Settings.load(None, env={"RELIABLE_CACHE__PREFIX": "billing-eu"}).cache.prefix == "billing-eu"
    with pytest.raises(SettingsError, match="cache.prefix = 'a:b' is not allowed"):
        Settings.load(None, env={"RELIABLE_CACHE__PREFIX": "a:b"})


def test_keyword_arguments_beat_environment_and_file_and_are_named(tmp_path):
    path = write(tmp_path, '[store]\nurl = "sqlite:///a.db"\n[worker]\nprefetch = 5\n')
    env = {"RELIABLE_STORE__URL": "sqlite:///b.db", "RELIABLE_WORKER__CONCURRENCY": "3"}
    settings = Settings.load(path, env=env, store={"url": "sqlite:///c.db"})
    assert settings.store.url == "sqlite:///c.db"
    assert (settings.worker.concurrency, settings.worker.prefetch) == (3, 5)  # tables merge key by key
    with pytest.raises(SettingsError, match=r"^argument worker: worker.concurrency = 'x' is not allowed"):
        Settings.load(path, env=env, worker={"concurrency": "x"})


def test_settings_constructed_directly_read_the_process_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "[worker]\nprefetch = 9\n")
    monkeypatch.setenv("RELIABLE_WORKER__CONCURRENCY", "4")
    settings = Settings()
    assert (settings.worker.concurrency, settings.worker.prefetch) == (4, 9)
    assert Settings(worker={"concurrency": 2}).worker.concurrency == 2


def test_a_list_variable_that_is_not_json_is_reported_as_its_value():
    message = load_error(None, {"RELIABLE_TRANSPORT__URL": "nats://127.0.0.1:4222",
                                "RELIABLE_TRANSPORT__SERVERS": "127.0.0.1:4223"})
    assert message == ("environment variable RELIABLE_TRANSPORT__SERVERS: transport.servers = '127.0.0.1:4223' "
                       "is not allowed; expected a list")


def test_a_handler_variable_keeps_its_value_as_written_unless_it_is_a_json_list_or_table():
    env = {"RELIABLE_HANDLERS__CHARGE__CACHE__PREFIX": "123", "RELIABLE_HANDLERS__CHARGE__OUTBOX__RELAY": "false",
           "RELIABLE_HANDLERS__CHARGE__RETRY__DELAY_LEVELS": '["1s", "1m"]'}
    charge = Settings.load(None, env=env).for_handler("charge")
    assert charge.cache.prefix == "123" and charge.outbox.relay is False
    assert charge.retry.delay_levels == [1.0, 60.0]


@pytest.mark.parametrize("section", ["transport", "cache", "store"])
def test_the_reference_names_exactly_the_url_schemes_a_section_takes(section: str) -> None:
    """docs/settings.md offered `mysql+pymysql://` for the store, which the settings refuse
    ("expected a store URL with scheme sqlite://, postgresql://, postgresql+psycopg://"), and left
    out `memory://`, `nats://` and `kafka://` transports and `rediss://` caches."""
    import re

    from backends.cache import ALLOWED_SCHEMES as CACHE
    from backends.store.engine import ALLOWED_SCHEMES as STORE
    from backends.transport import SCHEMES as TRANSPORT

    reference = (Path(__file__).parents[2] / "docs" / "settings.md").read_text()
    rows = reference.split(f"| **[{section}]** |", 1)[1].splitlines()
    url_row = next(row for row in rows if row.startswith("| `url` |"))
    documented = set(re.findall(r"`([a-z+]+)://", url_row.split("|")[3]))
    assert documented == set({"transport": TRANSPORT, "cache": CACHE, "store": STORE}[section])


def test_a_handler_table_no_handler_reads_is_named_when_the_app_runs(tmp_path: Path) -> None:
    """`[handlers.chrage.retry]` (for the handler `charge`) was ignored without a word: the
    override never applied. It is named when the app runs, with the near name; only a warning,
    since another app may share the settings file."""
    from structlog.testing import capture_logs

    from reliable.testing import test_app

    app = test_app(tmp_path, settings={"RELIABLE_HANDLERS__CHRAGE__RETRY__MAX_REDELIVERIES": "3",
                                       "RELIABLE_HANDLERS__CHARGE__RETRY__MAX_REDELIVERIES": "2"})

    @app.handler("payments")
    def charge(msg):  # type: ignore[no-untyped-def]
        pass

    with capture_logs() as logs:
        app.run(until_idle=True)
    app.close()
    assert [(e["table"], e["did_you_mean"], e["handlers"]) for e in logs
            if e["event"] == "handler_settings_unused"] == [("handlers.chrage", "handlers.charge", ["charge"])]
