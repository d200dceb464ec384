"""``embedded://DIR``: the project's broker in process (the default transport).

The engine (`broker.delivery`) runs in the process that first opens ``DIR``;
other processes on the machine that open the same ``DIR`` reach it over its
local socket (`broker.embedded`). Options: ``queues`` (per new topic),
``visibility_timeout`` (the lease of a delivered message), ``session_timeout``
(silence after which a member's queues move), ``flush`` (``async``, ``sync``
or ``none``: see the store's flush policies), ``max_deliveries`` and
``selection`` (``round_robin`` or ``latency_aware``: how a message without a
key finds its queue, see docs/broker-delivery.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import ConfigurationError
from backends.transport.broker import BrokerTransport
from broker.delivery.config import DeliveryConfig
from broker.embedded import open_embedded
from broker.errors import BrokerConfigError
from broker.store import StoreConfig
from broker.store.clock import Clock as BrokerClock


class EmbeddedTransport(BrokerTransport):
    """The broker engine in ``directory``, owned by this process or reached through its owner."""

    def __init__(self, directory: str | Path, clock: Clock = SYSTEM_CLOCK, *, queues: int = 4,
                 visibility_timeout: float = 30.0, session_timeout: float = 30.0,
                 flush: str = "async", max_deliveries: int = -1, selection: str = "round_robin") -> None:
        engine_clock = cast(BrokerClock, clock)
        try:
            config = DeliveryConfig(queues=queues, lease=visibility_timeout,
                                    session_timeout=session_timeout, max_deliveries=max_deliveries,
                                    selection=selection)
            store_config = StoreConfig(flush=flush, clock=engine_clock)  # type: ignore[arg-type]
        except BrokerConfigError as exc:
            raise ConfigurationError(f"transport embedded://{directory}: {exc}") from exc
        self.directory = Path(directory)
        super().__init__(open_embedded(directory, config, store_config=store_config, clock=engine_clock),
                         clock, visibility_timeout=visibility_timeout)
