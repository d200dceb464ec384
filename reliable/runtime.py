"""What a running handler needs: the backends, the clock, counters and randomness."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from backends.cache.base import Cache
from backends.clock import Clock
from backends.store.base import Store
from backends.transport.base import Transport
from reliable.log import Counters


@dataclass
class Runtime:
    """The backends and services shared by every handler of an app."""

    transport: Transport
    store: Store
    cache: Cache | None
    clock: Clock
    counters: Counters = field(default_factory=Counters)
    rng: random.Random = field(default_factory=random.Random)
