"""The cluster keys of ``[transport]``: ``replicas``, ``servers``, ``publish_timeout``; outage classification."""

from __future__ import annotations

from pathlib import Path

import nats.js.errors
import pytest
from confluent_kafka import KafkaError
from nats.js.api import RetentionPolicy, StreamConfig

from backends.errors import BackendUnavailableError, ConfigurationError, TransportError
from backends.transport import open_transport
from backends.transport.base import with_servers
from backends.transport.kafka_client import translate as kafka_translate
from backends.transport.nats_client import translate
from backends.transport.nats_streams import differences
from reliable.settings import Settings, SettingsError


def load(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "reliable.toml"
    path.write_text(text)
    return Settings.load(path, env={})


def error(tmp_path: Path, text: str) -> str:
    with pytest.raises(SettingsError) as info:
        load(tmp_path, text)
    return str(info.value)


def test_cluster_keys_become_transport_options(tmp_path: Path) -> None:
    settings = load(tmp_path, '[transport]\nurl = "nats://127.0.0.1:4222"\nreplicas = 3\n'
                              'servers = ["127.0.0.1:4223", "nats-2:4222"]\npublish_timeout = "1m"\n')
    assert settings.transport.options() == {
        "visibility_timeout": 30.0, "replicas": 3, "servers": ["127.0.0.1:4223", "nats-2:4222"]}
    assert settings.transport.publish_timeout == 60.0
    assert Settings.load(None, env={}).transport.options() == {"visibility_timeout": 30.0}


def test_bad_cluster_keys_name_key_value_and_what_is_allowed(tmp_path: Path) -> None:
    message = error(tmp_path, '[transport]\nurl = "kafka://k:9092"\nreplicas = 0\nservers = ["k2"]\n')
    assert "transport.replicas = 0 is not allowed; expected an integer >= 1" in message
    assert "transport.servers[0] = 'k2' is not allowed; expected host:port (port 1-65535)" in message
    message = error(tmp_path, '[transport]\nurl = "redis://127.0.0.1:6379"\nreplicas = 3\n')
    assert "transport.replicas = 3 is not allowed" in message
    assert "nats://, kafka://, amqp:// only (the transport is redis://)" in message
    env = {"RELIABLE_TRANSPORT__SERVERS": '["a:1"]'}
    with pytest.raises(SettingsError, match="RELIABLE_TRANSPORT__SERVERS: transport.servers"):
        Settings.load(None, env=env)  # the default transport (embedded://) is not a cluster


def test_servers_join_the_url_s_list() -> None:
    assert with_servers("nats://a:1?namespace=x", ["b:2", "c:3"]) == "nats://a:1,b:2,c:3?namespace=x"
    assert with_servers("kafka://a:1", "b:2") == "kafka://a:1,b:2"
    with pytest.raises(ConfigurationError, match="servers: 'b' is not host:port"):
        with_servers("nats://a:1", ["b"])


def test_a_transport_without_replicas_names_the_option() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown option\(s\) replicas"):
        open_transport("memory://", replicas=3)


def test_jetstream_without_a_leader_is_an_outage() -> None:
    assert isinstance(translate(nats.js.errors.NoStreamResponseError(), "publish"), BackendUnavailableError)
    for code, err_code in ((503, None), (500, 10008), (500, 10009)):
        error = nats.js.errors.APIError(code=code, err_code=err_code, description="election")
        assert isinstance(translate(error, "fetch"), BackendUnavailableError)
    refused = nats.js.errors.BadRequestError(code=400, err_code=10058, description="name in use")
    assert type(translate(refused, "create")) is TransportError


def test_stream_differences_are_named() -> None:
    existing = StreamConfig(name="s", subjects=["a"], retention=RetentionPolicy.WORK_QUEUE, num_replicas=1)
    wanted = StreamConfig(name="s", subjects=["a"], retention=RetentionPolicy.LIMITS, num_replicas=3)
    assert differences(existing, wanted, ("retention", "num_replicas", "subjects")) == [
        "retention workqueue (the settings want limits)", "num_replicas 1 (the settings want 3)"]


def test_a_kafka_partition_without_leader_or_enough_replicas_is_an_outage() -> None:
    for code in (KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
                 KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION,
                 KafkaError.FENCED_LEADER_EPOCH, KafkaError.ELIGIBLE_LEADERS_NOT_AVAILABLE):
        assert isinstance(kafka_translate(KafkaError(code), "produce"), BackendUnavailableError), code
    assert type(kafka_translate(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), "produce")) is TransportError
