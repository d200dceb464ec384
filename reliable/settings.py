"""The settings file: one TOML file, environment overrides, per-handler overrides, clear errors.

``Settings.load()`` reads the file named by its argument, else by
``RELIABLE_SETTINGS``, else ``./reliable.toml`` if it exists; with no file
everything runs embedded. Environment variables override keys
(``RELIABLE_STORE__URL``, ``RELIABLE_HANDLERS__CHARGE__RETRY__MAX_REDELIVERIES``:
a double underscore between levels). ``[handlers.NAME]`` tables override
sections for one handler (``for_handler``). Every problem is reported at load
time as a `SettingsError` naming the file (or variable), key, value and what
is allowed.

This module holds the models; pydantic-settings reads and merges the sources, which
`reliable.settings_loader` chooses (file lookup, environment mapping); turning
validation errors into those messages lives in
`reliable.settings_errors` (their public names are re-exported here).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from backends.cache import ALLOWED_SCHEMES as CACHE_SCHEMES
from backends.errors import ConfigurationError
from backends.store.engine import ALLOWED_SCHEMES as STORE_SCHEMES
from backends.transport import SCHEMES as TRANSPORT_SCHEMES
from reliable.durations import parse_duration
from reliable.retry import DelayLevels, InProcessRetry, RedeliveryPolicy
from reliable.settings_errors import Origin, SettingsError, describe
from reliable.settings_loader import (
    DEFAULT_FILE,
    ENV_PREFIX,
    NESTED,
    SETTINGS_ENV,
    EnvironmentSource,
    check_variables,
    file_source,
    find_file,
    layers,
    reading,
    variable_keys,
)

__all__ = [
    "DEFAULT_FILE",
    "ENV_PREFIX",
    "SETTINGS_ENV",
    "AtLeastOne",
    "BrokerSettings",
    "CacheSettings",
    "CacheUrl",
    "Cap",
    "CommitSettings",
    "Limit",
    "LogLevel",
    "LogSettings",
    "OutboxSettings",
    "Port",
    "PositiveSeconds",
    "RetrySettings",
    "Seconds",
    "Section",
    "ServerAddress",
    "Settings",
    "SettingsError",
    "StoreSettings",
    "StoreUrl",
    "TransportSettings",
    "TransportUrl",
    "WorkerSettings",
]

# -- value types: each names what it allows, in the words errors use ----------------


def _rule(test: Callable[[Any], bool], allowed: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if not test(value):
            raise ValueError(allowed)
        return value

    return AfterValidator(check)


def _seconds(allowed: str) -> BeforeValidator:
    """Durations may be written with a unit (``"5m"``); anything else must be a number."""

    def parse(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(allowed)  # noqa: TRY004 - pydantic reports ValueError, not TypeError
        if isinstance(value, str):
            try:
                return parse_duration(value)
            except ConfigurationError:
                raise ValueError(allowed) from None
        return value

    return BeforeValidator(parse)


def _no_bool(allowed: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(allowed)  # noqa: TRY004 - pydantic reports ValueError, not TypeError
        return value

    return BeforeValidator(check)


def _url(allowed: str, *specials: str) -> AfterValidator:
    return _rule(lambda v: v in specials or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", v) is not None, allowed)


_FRACTION = "a fraction >= 0 and < 1"
_UNITS = "(seconds, or a number with a unit: '500ms', '30s', '5m', '2h', '7d')"
_AT_LEAST_0 = f"a duration >= 0 {_UNITS}"
_ABOVE_0 = f"a duration > 0 {_UNITS}"
_CAP = f"a duration >= 0 {_UNITS}, or -1 for no cap"
Seconds = Annotated[float, _seconds(_AT_LEAST_0), _rule(lambda v: v >= 0, _AT_LEAST_0)]
PositiveSeconds = Annotated[float, _seconds(_ABOVE_0), _rule(lambda v: v > 0, _ABOVE_0)]
Cap = Annotated[float, _seconds(_CAP), _rule(lambda v: v >= 0 or v == -1, _CAP)]
AtLeastOne = Annotated[int, _no_bool("an integer >= 1"), _rule(lambda v: v >= 1, "an integer >= 1")]
Limit = Annotated[int, _no_bool("an integer >= 0, or -1"), _rule(lambda v: v >= -1, "an integer >= 0, or -1 for no limit")]
Port = Annotated[int, _no_bool("a port from 1 to 65535"), _rule(lambda v: 1 <= v <= 65535, "a port from 1 to 65535")]
def _scheme_url(kind: str, schemes: tuple[str, ...], *specials: str) -> AfterValidator:
    """A URL whose scheme is one a backend of ``kind`` handles (or one of ``specials``)."""
    allowed = f"a {kind} URL with scheme " + ", ".join(f"{name}://" for name in schemes)
    allowed += "".join(f", or {special!r}" for special in specials)
    return _rule(lambda v: v in specials or (v.partition("://")[0] in schemes and "://" in v), allowed)


TransportUrl = Annotated[str, _url("a URL with a scheme"), _scheme_url("transport", TRANSPORT_SCHEMES)]
StoreUrl = Annotated[str, _url("a URL with a scheme"), _scheme_url("store", STORE_SCHEMES)]
CacheUrl = Annotated[str, _url("a URL with a scheme, or 'none'", "none"),
                     _scheme_url("cache", CACHE_SCHEMES, "none")]
LogLevel = Annotated[
    Literal["debug", "info", "warning", "error", "critical"],
    BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v),
]


class Section(BaseModel):
    """A table of the settings file: unknown keys and infinite numbers are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


CLUSTERED = ("nats", "kafka", "amqp")
"""The transports of engines that run as clusters: they take ``replicas`` and ``servers``."""
ServerAddress = Annotated[str, _rule(lambda v: re.fullmatch(r"[^\s:/,]+:\d{1,5}", v) is not None
                                     and 0 < int(v.rpartition(":")[2]) < 65536, "host:port (port 1-65535)")]


class TransportSettings(Section):
    """``[transport]``: where messages come from and are acknowledged."""

    url: TransportUrl = "embedded://./.reliable/broker"
    visibility_timeout: PositiveSeconds = 30.0
    publish_timeout: Seconds = 30.0
    """How long ``App.publish`` retries a transport outage before raising it (0: no retry)."""
    replicas: AtLeastOne | None = None
    """Copies of each stream (nats://), topic (kafka://: its replication factor) or quorum queue
    (amqp://: its initial group size) on a cluster; unset: the transport's default."""
    servers: list[ServerAddress] = Field(default_factory=list)
    """More servers of the URL's cluster (``host:port``), tried when the URL's cannot be reached."""

    @field_validator("replicas", "servers")
    @classmethod
    def _clustered(cls, value: Any, info: ValidationInfo) -> Any:
        scheme = str(info.data.get("url", "")).partition("://")[0]
        if value and scheme not in CLUSTERED:
            raise ValueError(f"a cluster option of {', '.join(f'{c}://' for c in CLUSTERED)} only "
                             f"(the transport is {scheme}://)")
        return value

    def options(self) -> dict[str, Any]:
        """The keyword options `open_transport` takes from this section (cluster ones when set)."""
        options: dict[str, Any] = {"visibility_timeout": self.visibility_timeout}
        if self.replicas is not None:
            options["replicas"] = self.replicas
        if self.servers:
            options["servers"] = list(self.servers)
        return options


class CacheSettings(Section):
    """``[cache]``: fast "seen?" lookups of tokens (``none``: the store alone)."""

    url: CacheUrl = "memory://"
    ttl: PositiveSeconds = 86400.0
    prefix: Annotated[str, _rule(lambda v: bool(v) and ":" not in v, "a non-empty name without ':'")] = "reliable"
    """Start of every Redis key, so deployments sharing one Redis never skip each other's tokens."""


class StoreSettings(Section):
    """``[store]``: the durable token table, offsets and dead letters."""

    url: StoreUrl = "sqlite:///./.reliable/reliable.db"
    token_ttl: PositiveSeconds = 7 * 86400.0


class RetrySettings(Section):
    """``[retry]``: the redelivery policy and the in-process retry before it."""

    # the defaults are the policies' own (reliable.retry): one source for each
    initial_delay: Seconds = RedeliveryPolicy.initial_delay
    multiplier: Annotated[float, _no_bool("a number >= 1"), _rule(lambda v: v >= 1, "a number >= 1")] = RedeliveryPolicy.multiplier  # noqa: E501
    max_delay: Cap = RedeliveryPolicy.max_delay
    jitter: Annotated[float, _no_bool(_FRACTION), _rule(lambda v: 0 <= v < 1, _FRACTION)] = RedeliveryPolicy.jitter
    max_redeliveries: Limit | None = None  # the policy's: 6 (ActiveMQ), or 16 with delay_levels (RocketMQ)
    in_process_attempts: AtLeastOne = InProcessRetry.attempts
    in_process_max_wait: Seconds = InProcessRetry.max_wait
    delay_levels: list[Seconds] | None = None

    def policy(self) -> RedeliveryPolicy | DelayLevels:
        """`DelayLevels` when ``delay_levels`` is a non-empty list (redelivery n waits its n-th
        entry, the last one past the end), else `RedeliveryPolicy`."""
        limit = self.max_redeliveries
        if self.delay_levels:
            levels = tuple(self.delay_levels)
            limit = DelayLevels.max_redeliveries if limit is None else limit
            return DelayLevels(levels=levels, start_level=1, max_redeliveries=limit)
        return RedeliveryPolicy(
            initial_delay=self.initial_delay,
            multiplier=self.multiplier,
            max_delay=self.max_delay,
            jitter=self.jitter,
            max_redeliveries=RedeliveryPolicy.max_redeliveries if limit is None else limit,
        )

    def in_process(self) -> InProcessRetry:
        """The in-process retry: ``in_process_attempts`` calls, waits up to ``in_process_max_wait``."""
        return InProcessRetry(attempts=self.in_process_attempts, max_wait=self.in_process_max_wait)


class CommitSettings(Section):
    """``[commit]``: when progress is recorded."""

    strategy: Literal["per_message", "batch", "async", "transactional"] = "per_message"
    batch_size: AtLeastOne = 100
    interval: PositiveSeconds = 1.0


class WorkerSettings(Section):
    """``[worker]``: the consume loop."""

    concurrency: AtLeastOne = 1
    prefetch: AtLeastOne = 100
    poll_timeout: PositiveSeconds = 1.0


class OutboxSettings(Section):
    """``[outbox]``: the rows ``tx.publish`` writes and the relay that sends them."""

    name: Annotated[str, _rule(lambda v: bool(v) and len(v) <= 255, "a non-empty name of at most 255 characters")] = "default"
    """The outbox this app publishes into and relays from: apps sharing one database but not one
    transport need names of their own."""
    relay: bool = True
    """Run a relay inside every worker (``reliable run``); else only ``reliable relay`` sends."""
    batch_size: Annotated[int, _no_bool("an integer from 1 to 10000"),
                          _rule(lambda v: 1 <= v <= 10_000, "an integer from 1 to 10000")] = 500
    poll_interval: PositiveSeconds = 1.0
    """How long an idle relay waits when nothing wakes it (commits in process and PostgreSQL's
    NOTIFY wake it at once)."""
    retention: Seconds = 86400.0
    """How long sent rows are kept (for ``reliable outbox list``) before the relay deletes them."""
    max_backoff: PositiveSeconds = 5.0
    """The longest wait between attempts while the transport or the store is down."""


class LogSettings(Section):
    """``[log]``: structlog output."""

    level: LogLevel = "info"
    format: Literal["auto", "json", "console"] = "auto"


class BrokerSettings(Section):
    """``[broker]``: the broker server (``reliable broker serve``); the server checks its other
    keys (users, TLS, limits, ports) when it starts (`broker.server.config.ServerConfig`)."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: Port = 7600
    data_dir: str = "./.reliable/broker-server"
    flush: Literal["sync", "async", "none"] = "sync"
    selection: Literal["round_robin", "latency_aware"] = "round_robin"
    """How a published message without a key finds its queue (docs/broker-delivery.md)."""


class Settings(BaseSettings):
    """Everything `reliable` is configured with; see docs/settings.md.

    Keyword arguments win over ``RELIABLE_SECTION__KEY`` variables, which win
    over the settings file, which wins over the defaults; pydantic-settings
    reads and merges them. `load` is the checked entry point: it names the
    file or variable of every bad value.
    """

    model_config = SettingsConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, case_sensitive=False,
                                      env_prefix=ENV_PREFIX, env_nested_delimiter=NESTED)

    transport: TransportSettings = Field(default_factory=TransportSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    commit: CommitSettings = Field(default_factory=CommitSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    outbox: OutboxSettings = Field(default_factory=OutboxSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    handlers: dict[str, dict[str, Any]] = Field(default_factory=dict)

    _origin: Origin = PrivateAttr(default_factory=lambda: Origin(None))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The keyword arguments over the layers being read: by default the process's
        ``RELIABLE_`` variables over its settings file (no ``.env`` file, no secrets directory)."""
        return (init_settings, *layers()(settings_cls))

    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, str] | None = None,
             **values: Any) -> Settings:
        """The settings from ``path`` (else $RELIABLE_SETTINGS, else ./reliable.toml, else defaults)
        under the environment's overrides and ``values`` (``store={"url": ...}``); every handler's
        overrides are checked too."""
        environ = os.environ if env is None else env
        file = find_file(path, environ)
        check_variables(environ, cls.model_fields)
        origin = Origin(str(file) if file is not None else None, variable_keys(environ), values)
        with reading(lambda settings_cls: (EnvironmentSource(settings_cls, environ),
                                            file_source(settings_cls, file))):
            settings = _validate(values, origin, ())
        problems: list[str] = []
        for name in settings.handlers:
            try:
                settings.for_handler(name)
            except SettingsError as exc:
                problems.extend(exc.problems)
        if problems:
            raise SettingsError(problems)
        return settings

    def for_handler(self, name: str) -> Settings:
        """The effective settings of handler ``name``: its ``[handlers.NAME]`` tables over the rest."""
        overrides = self.handlers.get(name) or {}
        if "handlers" in overrides:
            where = self._origin.source(("handlers", name, "handlers"))
            raise SettingsError([f"{where}: handlers.{name}.handlers is not allowed; handler tables do not nest"])
        base = self.model_dump(exclude={"handlers"})
        with reading(lambda settings_cls: (InitSettingsSource(settings_cls, init_kwargs=dict(overrides)),
                                            InitSettingsSource(settings_cls, init_kwargs=base))):
            return _validate({}, self._origin, ("handlers", name))


def _validate(values: Mapping[str, Any], origin: Origin, prefix: tuple[str, ...]) -> Settings:
    """`Settings` from ``values`` over the layers being read, remembering ``origin``; errors are
    located under key ``prefix``."""
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        raise SettingsError([describe(error, origin, prefix, Settings) for error in exc.errors()]) from exc
    settings._origin = origin
    if settings.cache.ttl > settings.store.token_ttl:
        where = origin.source((*prefix, "cache", "ttl"))
        raise SettingsError([
            f"{where}: cache.ttl = {settings.cache.ttl:.0f}s is longer than store.token_ttl = "
            f"{settings.store.token_ttl:.0f}s; allowed: at most store.token_ttl (a token the store has "
            "forgotten must not still be skipped by the cache)"])
    return settings
