"""Every benchmark command of the README runs as written, at a size that fits a test.

The README gives each benchmark as an indented command line (``.venv/bin/python
-m benchmarks.NAME --messages 200000``). Each one runs here with the same
interpreter and the same options, only made small (`SMALL`), and must exit 0
and print a row of figures. Timing is never checked: that is the benchmarks'
own business, not the test suite's.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"^    \.venv/bin/python (.+?)(?:\s+#.*)?$", re.M)
SMALL = {  # option -> a size that runs in seconds
    "--messages": "2000", "--per-message": "40", "--batch": "1000", "--repeats": "1",
    "--seconds": "0.2", "--log-mb": "8", "--batches": "1", "--rows": "500", "--preload": "1000",
    "--rounds": "1", "--runs": "1", "--topics": "200", "--groups": "20",
}
SMALLER = {  # benchmarks whose small size is smaller still: every run is under valgrind
    "benchmarks.instructions": {"--messages": "500"},
}
LAST_CHECKOUT_ONLY = {  # benchmarks that count each checkout named (a run under valgrind each): the last one
    "benchmarks.instructions",
}
DEFAULTED = {  # benchmarks whose README command relies on their default sizes
    "benchmarks/store.py": ["--seconds", "--log-mb"],
    "benchmarks.spark_overhead": ["--batches", "--rows", "--preload"],
    "benchmarks.spark_source": ["--runs"],
    "benchmarks.broker_groups": ["--topics", "--groups"],
}


def commands() -> list[list[str]]:
    return [shlex.split(found) for found in COMMAND.findall((ROOT / "README.md").read_text())]


def small(arguments: list[str]) -> list[str]:
    """``arguments`` with every size option made small (and the sizes a benchmark defaults to)."""
    target = arguments[1] if arguments[0] == "-m" else arguments[0]
    sizes = {**SMALL, **SMALLER.get(target, {})}
    made = [sizes.get(arguments[i - 1], word) if i else word for i, word in enumerate(arguments)]
    if target in LAST_CHECKOUT_ONLY:  # every option takes a value, so a positional follows none
        positional = [i for i, word in enumerate(made) if i > 1 and not made[i - 1].startswith("-")
                      and not word.startswith("-")]
        made = [word for i, word in enumerate(made) if i not in positional[:-1]]
    return made + [word for option in DEFAULTED.get(target, []) if option not in made
                   for word in (option, SMALL[option])]


def test_the_readme_names_its_benchmarks():
    named = {words[1] if words[0] == "-m" else words[0] for words in commands()}
    assert {"benchmarks.handler_overhead", "benchmarks.broker_embedded", "benchmarks.broker_vs_peers",
            "benchmarks.transports", "benchmarks/store.py"} <= named


@pytest.mark.parametrize("arguments", commands(), ids=lambda words: " ".join(words[:2]))
def test_benchmark_command_runs(arguments: list[str]) -> None:
    run = subprocess.run([sys.executable, *small(arguments)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{' '.join(arguments)}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert re.search(r"\d[\d,.]*\s", run.stdout), f"{' '.join(arguments)} printed no figures:\n{run.stdout}"
