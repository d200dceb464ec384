"""The broker in process: `open_embedded(DIR)`, shared by the processes of one machine.

The first process to open ``DIR`` owns it: it runs the engine (`Broker`) and
serves it on ``DIR/broker.sock`` (`broker.local`). A process that opens the
same directory while it is owned reaches the owner through that socket. When
the owner exits, the next call of another process finds the socket gone,
reports the broker unavailable once (callers retry with backoff) and on the
following call takes the directory over: ownership passes, nothing stored is
lost, and members of the old owner join again (their unacknowledged
messages are delivered again, counted).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from broker.delivery.api import BrokerApi
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.errors import BrokerUnavailableError, StoreLockedError
from broker.local import LocalClient, LocalServer, socket_path
from broker.store import Clock, StoreConfig
from broker.store.clock import SYSTEM_CLOCK

log = structlog.get_logger("broker.embedded")
CONNECT_WAIT = 10.0  # seconds a new owner may take to start serving its socket


class EmbeddedBroker:
    """A `BrokerApi` for ``directory``: the engine if this process owns it, else the owner's socket."""

    def __init__(self, directory: str | Path, config: DeliveryConfig | None = None, *,
                 store_config: StoreConfig | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # the owner's alone (broker.local)
        self._config = config
        self._store_config = store_config
        self._clock = clock
        self._lock = threading.Lock()
        self._engine: Broker | None = None
        self._server: LocalServer | None = None
        self._client: LocalClient | None = None
        self._closed = False

    @property
    def owner(self) -> bool:
        """Whether this process runs the engine (else it is a client of the owner)."""
        return self._engine is not None

    @property
    def engine(self) -> Broker:
        """The engine, taking the directory over if nobody owns it (tests, admin)."""
        api = self._api()
        if not isinstance(api, Broker):
            raise BrokerUnavailableError(f"{self.directory} is owned by another process")
        return api

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_") or not hasattr(Broker, method):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._forward(method, args, kwargs)

    def _forward(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        api = self._api()
        try:
            return getattr(api, method)(*args, **kwargs)
        except BrokerUnavailableError:
            self._drop_client(api)
            raise

    def _api(self) -> BrokerApi:
        with self._lock:
            if self._closed:
                raise BrokerUnavailableError(f"the embedded broker in {self.directory} is closed")
            if self._engine is not None:
                return self._engine
            if self._client is not None:
                return self._client
            try:
                self._engine = Broker(self.directory, self._config, store_config=self._store_config,
                                      clock=self._clock)
            except StoreLockedError:
                self._client = self._connect()
                return self._client
            self._server = LocalServer(self._engine, self.directory)
            atexit.register(self.close)  # offsets and the checkpoint written on a normal exit too
            log.info("embedded.owner", directory=str(self.directory))
            return self._engine

    def _connect(self) -> LocalClient:
        """A client of the owner, once its socket answers (it may be starting): retried as the
        server's client retries (tenacity), for at most ``CONNECT_WAIT`` seconds."""
        client = LocalClient(self.directory)
        try:
            for attempt in Retrying(retry=retry_if_exception_type(BrokerUnavailableError),
                                    wait=wait_fixed(0.05), stop=stop_after_delay(CONNECT_WAIT),
                                    reraise=True):
                with attempt:
                    client.topics()
        except BrokerUnavailableError:
            raise BrokerUnavailableError(
                f"{self.directory} is owned by another process that does not answer on "
                f"{socket_path(self.directory)}") from None
        log.info("embedded.client", directory=str(self.directory))
        return client

    def _drop_client(self, api: BrokerApi) -> None:
        with self._lock:
            if api is self._client and self._client is not None:
                self._client.close()
                self._client = None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self.close)  # else the hook keeps this closed engine for the process's life
            if self._server is not None:
                self._server.close()
            if self._engine is not None:
                self._engine.close()
            if self._client is not None:
                self._client.close()

    def __enter__(self) -> EmbeddedBroker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_embedded(directory: str | Path, config: DeliveryConfig | None = None, *,
                  store_config: StoreConfig | None = None, clock: Clock = SYSTEM_CLOCK) -> EmbeddedBroker:
    """The broker in ``directory`` for this process (see `EmbeddedBroker`)."""
    return EmbeddedBroker(directory, config, store_config=store_config, clock=clock)
