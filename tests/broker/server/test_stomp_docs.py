"""The stomp.py example of docs/broker-stomp.md runs as written against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.broker.server.serving import ROOT
from tests.broker.server.test_stomp_errors import server  # noqa: F401  (the module's server)

PAGE = ROOT / "docs" / "broker-stomp.md"


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert len(blocks) == 1, "the page has one Python example"
    return blocks[0]


def test_the_documented_example_runs_as_written(server, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "example.py"
    script.write_text(example())
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "STOMP_PORT": str(server.stomp_port)})
    assert done.returncode == 0, done.stderr
    assert "got order 1 redelivered: false" in done.stdout
