"""What happened to one micro-batch (returned by the wrapped function, and logged)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class BatchStatus(enum.Enum):
    """The end state of a micro-batch."""

    COMMITTED = "committed"  # fence, tokens, dead letters and the sink's store writes committed
    REPLAYED = "replayed"  # already committed by this run: skipped
    DEAD_LETTERED = "dead_lettered"  # retries spent: every row went to the dead-letter table


@dataclass(frozen=True)
class BatchReport:
    """One batch's outcome.

    ``duplicates`` counts tokens already recorded (known to the cache, or
    found by the claim: an earlier batch or a concurrent writer recorded
    them); copies of a token within the batch are not counted; ``cached``
    tells whether the rows were cached between the token read and the
    function (see `batch.prepare`); ``ahead`` whether the claim was sent
    ahead of the function (``sink="store"``, see `ahead`); ``seconds`` times the phases of the last attempt (``prepare`` on the
    executors, ``claim``, ``function``: the user's function) on the app's clock.
    """

    name: str
    batch_id: int
    run_id: str
    status: BatchStatus
    attempts: int
    written: int = 0
    duplicates: int = 0
    poison: int = 0
    cached: bool = False
    ahead: bool = False
    seconds: dict[str, float] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The report as log fields."""
        return {**asdict(self), "status": self.status.value}
