"""What durable acks cost: consume+ack of this checkout next to another one's, in one run.

Runs ``benchmarks.broker_vs_peers --consume-only 1`` (the sync client: fetch 500, ack them,
server with ``flush = "sync"``) alternately in this checkout and in ``--other`` (e.g. a
worktree of the commit before the ack journal), ``--rounds`` times each, interleaved so a
busy machine weighs on both alike, and prints every round's rates, the median and best of
each and their ratio.

    python -m benchmarks.ack_cost --other /path/to/other/checkout [--rounds 5] [--messages 20000]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RATE = re.compile(r"consume\+ack\s+([\d,]+) msg/s")


def consume_ack(checkout: Path, messages: int) -> float:
    """One consume+ack rate (messages a second) measured by ``checkout``'s own code."""
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.broker_vs_peers", "--consume-only", "1", "--messages",
         str(messages)], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True, text=True, check=True).stdout
    found = RATE.search(output)
    if found is None:
        raise RuntimeError(f"no consume+ack rate in the output of {checkout}:\n{output}")
    return float(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"this": [], "other": []}
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'round':>5} {'this msg/s':>12} {'other msg/s':>12} {'ratio':>7}")
    for number in range(1, args.rounds + 1):
        order = [("this", HERE), ("other", args.other)]
        for name, checkout in order if number % 2 else reversed(order):
            rates[name].append(consume_ack(checkout, args.messages))
        print(f"{number:>5} {rates['this'][-1]:>12,.0f} {rates['other'][-1]:>12,.0f} "
              f"{rates['this'][-1] / rates['other'][-1]:>7.2f}")
    for summary, pick in (("median", statistics.median), ("best", max)):
        this, other = pick(rates["this"]), pick(rates["other"])
        print(f"{summary:>6} {this:>11,.0f} {other:>12,.0f} {this / other:>7.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
