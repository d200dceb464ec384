"""docs/broker-server.md lists every operation's permission exactly as the operation table declares it."""

from __future__ import annotations

import re
from pathlib import Path

from broker.protocol.operations import permission_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "broker-server.md"
BLOCK = re.compile(r"<!-- operations:begin -->\n(.*?)<!-- operations:end -->", re.S)


def test_the_permission_table_of_the_docs_is_the_operation_tables() -> None:
    found = BLOCK.search(DOC.read_text())
    assert found is not None, f"{DOC} has no operations block"
    assert found.group(1) == permission_table(), (
        "docs/broker-server.md is out of date; paste this between the operations markers:\n"
        + permission_table())
