"""The ``[broker]`` table is validated when the server starts: every key, named with its value.

Each bad value below once started a server (or failed later, on the first
connection); now it stops the start with a `BrokerConfigError` naming the key.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from broker.errors import BrokerConfigError
from broker.server.config import ServerConfig
from broker.server.run import store_config
from broker.server.server import load_config
from tests.broker.server.serving import ROOT

BAD_VALUES: list[tuple[str, Any]] = [
    ("idle_timeout", "abc"), ("slow_client_timeout", 0), ("handshake_timeout", -1),
    ("max_fetch_wait", "30"), ("max_frame_size", 0), ("max_connections", 1.5),
    ("stomp_prefetch", True), ("max_transactions", 0), ("max_transaction_bytes", "1M"),
    ("stomp_max_redeliveries", -1), ("stomp_redelivery_delay", "1s"),
    ("stomp_redelivery_multiplier", 0.5), ("port", 70000), ("stomp_port", "61613"),
    ("metrics_port", -1), ("host", 127), ("allow_open_network", "yes"), ("unix_socket", 5),
    ("data_dir", 1), ("tls_require_client_cert", "no"), ("auth_failure_delay", -0.1),
    ("auth_max_failures", 0), ("auth_window", "5m"), ("auth_lockout", 0), ("auth_max_lockout", 10),
    ("auth_tracked", 10), ("auth_concurrency", 0), ("auth_shared_addresses", "10.0.0.0/8"),
    ("auth_shared_addresses", ["10.0.0.0/33"]), ("max_connections_per_address", 0),
    ("max_connections_per_address_overrides", ["10.0.0.5"]),
    ("max_connections_per_address_overrides", {"10.0.0.300": 5}),
    ("max_connections_per_address_overrides", {"10.0.0.5": 0}),
    ("max_connections_per_address_overrides", {"10.0.0.0/8": "many"}),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_a_bad_value_is_refused_naming_its_key(key: str, value: Any) -> None:
    table: dict[str, Any] = {key: value}
    if key.startswith("tls_"):
        table.update(tls_certfile="cert.pem", tls_keyfile="key.pem")
    with pytest.raises(BrokerConfigError, match=rf"broker\.{key} = "):
        ServerConfig.from_mapping(table)


def test_the_good_values_pass() -> None:
    config = ServerConfig.from_mapping({"idle_timeout": 5, "handshake_timeout": 0.5,
                                        "max_transactions": 4, "data_dir": "here", "flush": "sync",
                                        "auth_failure_delay": 0.5, "auth_concurrency": 4, "auth_max_failures": 10,
                                        "auth_shared_addresses": ["10.1.2.3", "fd00::/8"]})
    assert config.limits.idle_timeout == 5 and config.limits.max_transactions == 4
    assert config.limits.auth_failure_delay == 0.5 and config.limits.auth_concurrency == 4
    assert config.limits.auth_max_failures == 10 and len(config.limits.shared_networks) == 2


def test_the_connection_caps_come_from_the_settings_file_the_most_specific_override_first(tmp_path) -> None:
    settings = tmp_path / "reliable.toml"
    settings.write_text('[broker]\nmax_connections_per_address = 32\n'
                        'max_connections_per_address_overrides = { "10.0.0.0/8" = 256, "10.0.0.5" = 1024 }\n')
    limits = load_config(settings).limits
    assert limits.max_connections_per_address == 32
    assert [(str(net), cap) for net, cap in limits.address_overrides] == [("10.0.0.5/32", 1024), ("10.0.0.0/8", 256)]
    assert ServerConfig().limits.max_connections_per_address == 128  # a default below max_connections


@pytest.mark.parametrize(("key", "value"), [("idle_timeout", '"abc"'), ("flush", '"sometimes"'),
                                            ("max_deliveries", '"often"'), ("max_fetch_bytes", "0"), ("max_groups", "0"),
                                            ("retention", '"3d"'), ("force_at", "0.95")])
def test_a_server_with_a_bad_value_does_not_start(tmp_path, key: str, value: str) -> None:
    settings = tmp_path / "reliable.toml"
    settings.write_text(f"[broker]\n{key} = {value}\n")
    run = subprocess.run([sys.executable, "-m", "broker", "serve", "--settings", str(settings),
                          "--data-dir", str(tmp_path / "data"), "--port", "0", "--stomp-port", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "BrokerConfigError" in run.stderr and key in run.stderr.splitlines()[-1]


def test_the_store_keys_reach_the_store() -> None:
    """Retention and the disk thresholds come from the table; forced deletion stays off unless set."""
    assert store_config({}).force_at is None and store_config({}).flush.value == "sync"
    config = store_config({"retention": 3600, "clean_at": 0.6, "force_at": 0.8, "refuse_at": 0.85,
                           "flush": "async"})
    assert (config.retention, config.clean_at, config.force_at, config.refuse_at) == (3600, 0.6, 0.8, 0.85)
    assert config.flush.value == "async"


@pytest.mark.parametrize("key", ["port", "stomp_port", "metrics_port"])
def test_a_port_in_use_stops_the_start_naming_its_key(tmp_path, key: str) -> None:
    """A port another program holds ended `reliable broker serve` in an OSError traceback."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        settings = tmp_path / "reliable.toml"
        settings.write_text("[broker]\n" + "".join(f"{k} = {v}\n" for k, v in {"port": 0, "stomp_port": 0, key: port}.items()))
        run = subprocess.run([sys.executable, "-c", "from reliable.cli import main; main()", "broker", "serve",
                              "--settings", str(settings), "--data-dir", str(tmp_path / "data")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (run.returncode, "Traceback" in run.stderr) == (2, False), run.stderr
    assert run.stderr.splitlines()[-1] == (f"error: broker.{key} = {port}: cannot listen on 127.0.0.1:{port}: "
                                           "Address already in use; choose another port (0: any free one)")
