"""The broker in process, counted in instructions per message: checkouts side by side.

Wall-clock rates on a shared machine move by a third within minutes; the number of
instructions a fixed workload executes does not. Each checkout runs the same embedded
workload under ``valgrind --tool=callgrind`` (every thread counted), with its own code on
``PYTHONPATH`` and a fixed hash seed, in four legs of N messages (256 bytes, 4 queues):

  1. `Broker.publish`, 500 per call          (warm-up: the imports, the broker's opening)
  2. `Broker.publish` of N more               -> produce
  3. one member: `fetch(500)`, `ack(receipts)` of the first N   (warm-up: the join)
  4. the same for the next N                  -> consume+ack

Callgrind dumps its count at the start of every leg but the first (``--dump-before`` the
workload's mark, `os.getppid`, which nothing else calls), so legs 2 and 4 are counted
alone: the interpreter's start, the imports and the broker's opening drop out, and one
valgrind run per checkout gives both figures. The store runs with ``flush = "none"`` and
no checkpoint thread, the offsets are written at close only: a thread that wakes on a timer
would do more the slower valgrind runs, so the count would move with the machine's load
(the engine's code is the same as under ``async``).

The table gives every checkout's instructions per message and its ratio to the first one
(e.g. the commit before a change, then this checkout). A checkout is a folder, or a git
revision of this repository, which is checked out in a temporary worktree for the run and
removed after.

    python -m benchmarks.instructions [--messages N] [CHECKOUT|REVISION ...]
    python -m benchmarks.instructions --workload --messages N   # the workload once, no valgrind

Needs ``valgrind`` on PATH. A run of 10,000 messages takes a minute or two per checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
BATCH = 500
TOTALS = re.compile(r"^totals: (\d+)", re.M)


MARK = "getppid"  # the C function behind `os.getppid`: callgrind dumps its count before each call


def workload(count: int) -> None:
    """The four legs of ``count`` messages (this checkout's code), each but the first marked."""
    import logging

    import structlog

    from broker.delivery.config import DeliveryConfig
    from broker.delivery.engine import Broker
    from broker.delivery.values import OutgoingMessage
    from broker.store import StoreConfig
    from broker.store.config import FlushPolicy

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(f"broker from {sys.modules['broker'].__file__}")  # checked by `instructions`
    with tempfile.TemporaryDirectory() as folder:
        # no thread that wakes on a timer: what it did would grow with valgrind's slowness
        broker = Broker(folder, DeliveryConfig(queues=4, prefetch=BATCH * 2, offset_flush_interval=3600),
                        store_config=StoreConfig(flush=FlushPolicy.NONE, checkpoint_interval=0))
        batch = [OutgoingMessage(bytes(256)) for _ in range(BATCH)]
        for leg in range(2):
            if leg:
                os.getppid()  # the mark: leg 2 starts
            for _ in range(count // BATCH):
                broker.publish("bench", batch)
        member = broker.join("g", ["bench"])
        for _ in range(2):
            os.getppid()  # the mark: leg 3, then leg 4, starts
            done = 0
            while done < count:
                deliveries = broker.fetch(member, BATCH, 1.0)
                broker.ack(member, [d.receipt for d in deliveries])
                done += len(deliveries)
        os.getppid()  # the mark: leg 4 ends
        broker.close()


def legs(checkout: Path, count: int) -> list[int]:
    """The instructions of each leg of the workload (`workload`) run on ``checkout``'s code."""
    with tempfile.TemporaryDirectory() as folder:
        # this file runs as a script, so the broker it imports is the one on ``PYTHONPATH``
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/out", f"--dump-before={MARK}",
                   sys.executable, __file__, "--workload", "--messages", str(count)]
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0"})
        if done.returncode:
            raise RuntimeError(f"callgrind of {checkout} ({count}) failed:\n{done.stderr[-2000:]}")
        if f"broker from {checkout}/broker/" not in done.stdout:
            raise RuntimeError(f"the workload did not import {checkout}'s broker:\n{done.stdout}")
        dumps = sorted(Path(folder).glob("out.*"), key=lambda path: int(path.suffix[1:]))
        if len(dumps) != 4:  # something else called the mark: the legs cannot be told apart
            raise RuntimeError(f"callgrind dumped {len(dumps)} times before {MARK}, not at the workload's 4 marks")
        return [int(TOTALS.search(path.read_text()).group(1)) for path in dumps]  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*",
                        help="folders or git revisions to count, the first the reference (default: this checkout)")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--workload", action="store_true", help="run the workload once, no valgrind")
    arguments = parser.parse_args()
    count = arguments.messages // BATCH * BATCH
    if arguments.workload:
        workload(count)
        return
    print(f"instructions per message (legs of {count} messages after a leg of as many)")
    print(f"{'checkout':<40}{'produce':>10}{'consume+ack':>13}{'ratio':>8}{'ratio':>8}")
    first: tuple[float, float] | None = None
    with ExitStack() as stack:
        checkouts = [stack.enter_context(_checkout(name)) for name in arguments.checkouts] or [HERE]
        for checkout in checkouts:
            _, produced, _, consumed = legs(checkout, count)  # the dumps of legs 1 to 4, in order
            produce, consume = produced / count, consumed / count
            first = first or (produce, consume)
            print(f"{_name(checkout):<40}{produce:>10,.0f}{consume:>13,.0f}"
                  f"{produce / first[0]:>8.3f}{consume / first[1]:>8.3f}", flush=True)


@contextmanager
def _checkout(name: str) -> Iterator[Path]:
    """The folder ``name``, or a temporary worktree of the git revision ``name`` (removed after)."""
    if Path(name).is_dir():
        yield Path(name).resolve()
        return
    with tempfile.TemporaryDirectory() as parent:
        folder = Path(parent) / name.replace("/", "_")
        added = subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(folder), name],
                               capture_output=True, text=True)
        if added.returncode:
            raise SystemExit(f"{name!r} is neither a folder nor a git revision: {added.stderr.strip()}")
        try:
            yield folder
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(folder)],
                           capture_output=True)


def _name(checkout: Path) -> str:
    head = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"],
                          capture_output=True, text=True).stdout.strip()
    return (head or str(checkout))[:38]


if __name__ == "__main__":
    main()
