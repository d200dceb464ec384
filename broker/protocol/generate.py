"""`broker/delivery/api.py` written from the operation table: ``python -m broker.protocol.generate``.

`BrokerApi` has one method per operation whose ``method`` is a call of the
engine (`Operation.api`): its arguments are the operation's fields
(`Field.keyword`, `Field.wire_only`), annotated with their `Kind`'s
``python``, its return the reply's, its docstring the operation's ``doc``.
Calls every implementation has that are not on the wire are declared here
(`LOCAL`). ``--check`` exits 1 if the file on disk is not what the table
makes (tests/broker/server/test_operation_api.py does the same).
"""

from __future__ import annotations

import builtins
import re
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

from broker.delivery import values
from broker.protocol.operations import OPERATIONS, REQUIRED, Field, Operation

TARGET = Path(__file__).resolve().parents[1] / "delivery" / "api.py"
WIDTH = 100
INDENT = "    "
DOC_SLACK = 10  # a one-line docstring may run this far past WIDTH before it is wrapped

HEADER = '''"""The delivery engine's one synchronous interface, `BrokerApi`.

Generated from `broker.protocol.operations` by ``python -m broker.protocol.generate``:
edit the operation table (or that module's `LOCAL`), not this file.

Three things implement it: the engine itself, in process (`broker.delivery`),
the client of the broker server (`broker.client`, over TCP or the local
socket of an embedded broker owned by another process), and test doubles.
The framework's broker transport (`backends/transport/broker.py`) is written
once over this interface, so `embedded://DIR` and `reliable://host:port` share
it; the server's asyncio `Engine` (`broker/server/engine.py`) is this
interface run off the event loop.

A group member is a handle (``member``) that `BrokerApi.join` hands out;
every delivery carries an opaque ``receipt`` that the member acks, nacks or
dead-letters. Any call by a member counts as its heartbeat. When a member
leaves, or stops calling for longer than the group's session timeout, what it
held unacknowledged is redelivered to the group.

Calls the engine cannot serve raise `broker.errors.BrokerError` subclasses.
Implementations may add keyword arguments with defaults and further methods;
the calls below keep their meaning everywhere.
"""
'''

LOCAL = {"close": ("", "None", "Flush and release what this handle holds.")}
"""Calls of every `BrokerApi` that are not operations: method -> (parameters, return, doc)."""

_FROM = {"Mapping": "collections.abc", "Sequence": "collections.abc", "Any": "typing",
         "Protocol": "typing"}


def _parameter(field: Field) -> str:
    python = field.kind.python
    if not field.keyword:
        return f"{field.name}: {python}"
    if field.default is REQUIRED:
        raise TypeError(f"field {field.name!r}: a keyword argument needs a default")
    if field.default is None and not python.endswith("| None"):
        python += " | None"
    return f"{field.name}: {python} = {field.default!r}"


def _parameters(op: Operation) -> str:
    called = [f for f in op.fields if not f.wire_only]
    positional = [_parameter(f) for f in called if not f.keyword]
    keyword = [_parameter(f) for f in called if f.keyword]
    return ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])


def _wrapped(head: str, parameters: str, tail: str) -> list[str]:
    """``def head(parameters) tail``, its parameters broken over lines to fit ``WIDTH``."""
    line = f"{INDENT}def {head}({parameters}){tail}"
    if len(line) <= WIDTH:
        return [line]
    lines, current, hang = [], f"{INDENT}def {head}(", " " * len(f"{INDENT}def {head}(")
    parts = parameters.split(", ")
    for index, part in enumerate(parts):
        end = len(tail) + 1 if index == len(parts) - 1 else 1
        if not current.endswith("(") and len(current) + len(part) + 2 + end > WIDTH:
            lines.append(current + ",")
            current = hang + part
        else:
            current += part if current.endswith("(") else ", " + part
    return [*lines, current + f"){tail}"]


def _method(name: str, parameters: str, returns: str, doc: str) -> list[str]:
    body = f'{INDENT * 2}"""{doc}"""'
    if len(body) > WIDTH + DOC_SLACK:
        body = textwrap.fill(f'"""{doc}', WIDTH, initial_indent=INDENT * 2,
                             subsequent_indent=INDENT * 2, break_on_hyphens=False) + '"""'
    return ["", *_wrapped(name, parameters, f" -> {returns}:"), body]


def _imports(annotations: Iterable[str]) -> list[str]:
    names = set(re.findall(r"[A-Za-z_]\w*", " ".join(annotations))) - set(dir(builtins)) - {"None"}
    unknown = names - set(_FROM) - set(dir(values))
    if unknown:
        raise TypeError(f"annotations name {sorted(unknown)}: neither broker.delivery.values nor "
                        f"{sorted(_FROM)}")
    names.add("Protocol")
    lines = ["from __future__ import annotations", ""]
    for module in ("collections.abc", "typing"):
        used = sorted(n for n in names if _FROM.get(n) == module)
        if used:
            lines.append(f"from {module} import {', '.join(used)}")
    ours = sorted(names - set(_FROM))
    if ours:
        lines += ["", "from broker.delivery.values import (", *(f"{INDENT}{n}," for n in ours), ")"]
    return lines


def render(operations: Iterable[Operation] = OPERATIONS.values()) -> str:
    """The text of broker/delivery/api.py for ``operations``."""
    methods: list[str] = []
    annotations: list[str] = []
    for op in operations:
        if not op.api:
            continue
        if not op.doc:
            raise TypeError(f"operation {op.name!r} is a BrokerApi call and has no doc")
        returns = "None" if op.reply is None else op.reply.kind.python
        parameters = _parameters(op)
        annotations += [*(f.kind.python for f in op.fields if not f.wire_only), returns]
        methods += _method(op.method, parameters, returns, op.doc)
    for name, (parameters, returns, doc) in LOCAL.items():
        annotations += [*re.findall(r":\s*([^,=]+)", parameters), returns]
        methods += _method(name, ", ".join(["self", *([parameters] if parameters else [])]), returns, doc)
    lines = [*_imports(annotations), "", "", "class BrokerApi(Protocol):",
             f'{INDENT}"""Publish, consume as a group member, acknowledge by receipt, inspect."""',
             *methods]
    return HEADER + "\n" + "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is stale: run python -m broker.protocol.generate", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
