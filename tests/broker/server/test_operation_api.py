"""`BrokerApi` (broker/delivery/api.py) is generated from the operation table and is not stale."""

from __future__ import annotations

import dataclasses
import inspect

from broker.delivery.api import BrokerApi
from broker.delivery.engine import Broker
from broker.protocol import generate
from broker.protocol.operations import OPERATIONS


def test_the_file_on_disk_is_what_the_operation_table_generates() -> None:
    assert generate.TARGET.read_text() == generate.render(), (
        f"{generate.TARGET} is stale: run python -m broker.protocol.generate")
    assert generate.main(["--check"]) == 0


def test_a_changed_operation_makes_the_file_stale() -> None:
    ops = dict(OPERATIONS)
    ops["ack"] = dataclasses.replace(ops["ack"], doc="Something else.")
    assert generate.render(ops.values()) != generate.TARGET.read_text()


def test_the_protocol_has_the_engines_calls_and_only_them() -> None:
    methods = {name for name, _ in inspect.getmembers(BrokerApi, inspect.isfunction)
               if not name.startswith("_")}
    engine_calls = {op.method for op in OPERATIONS.values() if op.api}
    assert methods == engine_calls | set(generate.LOCAL)
    assert {"lookup_key", "lookup_id", "dlq_waiting", "stats", "ping"}.isdisjoint(methods)
    assert {"publish", "join", "leave", "dlq_list"} <= methods
    for name in methods:
        assert callable(getattr(Broker, name)), name
        assert getattr(BrokerApi, name).__doc__, name


def test_the_engine_and_the_clients_take_the_generated_arguments() -> None:
    for op in OPERATIONS.values():
        if not op.api:
            continue
        wanted = [f.name for f in op.fields if not f.wire_only]
        assert list(inspect.signature(getattr(BrokerApi, op.method)).parameters)[1:] == wanted
        engine = inspect.signature(getattr(Broker, op.method)).parameters
        assert wanted == list(engine)[1:len(wanted) + 1], op.method
