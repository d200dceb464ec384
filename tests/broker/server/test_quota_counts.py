"""``max_topics_per_user`` and ``max_groups_per_user`` count what a user made and what exists.

Two ways a user lost its quota, or got it back, for nothing: a request that named a new topic
and was refused (here a subscribe of a new group past ``max_groups_per_user``) was charged a
topic the broker never made, so a few refused requests left the user unable to make a topic;
and a restart forgot every count, so a user at its limit started again from zero. A real
server, restarted over its own directory.
"""

from __future__ import annotations

import urllib.request
from contextlib import closing
from pathlib import Path

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import TooManyGroupsError, TooManyTopicsError
from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_group_quota import _user

PER_USER = 3


def _server(folder: Path) -> ServerProcess:
    settings = folder / "reliable.toml"
    settings.write_text(f"[broker]\nmax_topics_per_user = {PER_USER}\nmax_groups_per_user = {PER_USER}\n"
                        "metrics_port = 0\n" + _user("orders", "orders.*", "orders-*"))
    return ServerProcess(folder / "data", "--settings", str(settings)).start()


def _scraped(server: ServerProcess) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()


def test_a_refused_request_naming_a_new_topic_costs_the_user_nothing(tmp_path, unique) -> None:
    server = _server(tmp_path)
    try:
        with closing(Client(server.url, user="orders", password="orders")) as orders:
            orders.publish(f"orders.{unique}.0", [OutgoingMessage(b"x")])
            for n in range(PER_USER):  # the user's last group it may make
                orders.leave(orders.join(f"orders-{unique}-{n}", [f"orders.{unique}.0"]))
            for n in range(PER_USER + 1):  # a new group over a new topic: refused, nothing made
                with pytest.raises(TooManyGroupsError):
                    orders.leave(orders.join(f"orders-{unique}-more", [f"orders.{unique}.new{n}"]))
            assert f"orders.{unique}.new0" not in {t.name for t in orders.topics()}
            for n in (1, 2):  # the user's topics still to make: two more
                orders.publish(f"orders.{unique}.{n}", [OutgoingMessage(b"x")])
            with pytest.raises(TooManyTopicsError):
                orders.publish(f"orders.{unique}.3", [OutgoingMessage(b"x")])
        assert 'broker_user_topics{user="orders"} 3.0' in _scraped(server)
    finally:
        server.stop()


def test_a_restart_keeps_what_each_user_made(tmp_path, unique) -> None:
    server = _server(tmp_path)
    try:
        with closing(Client(server.url, user="orders", password="orders")) as orders:
            for n in range(PER_USER):
                orders.publish(f"orders.{unique}.{n}", [OutgoingMessage(b"x")])
                orders.leave(orders.join(f"orders-{unique}-{n}", [f"orders.{unique}.0"]))
        server.stop()
        server.log.write_text("")  # its start waits for the new server's ports, not the old ones
        server.start()
        with closing(Client(server.url, user="orders", password="orders")) as orders:
            with pytest.raises(TooManyTopicsError, match="max_topics_per_user=3"):
                orders.publish(f"orders.{unique}.after", [OutgoingMessage(b"x")])
            with pytest.raises(TooManyGroupsError, match="max_groups_per_user=3"):
                orders.leave(orders.join(f"orders-{unique}-after", [f"orders.{unique}.0"]))
            orders.publish(f"orders.{unique}.2", [OutgoingMessage(b"y")])  # what it made still works
            orders.leave(orders.join(f"orders-{unique}-2", [f"orders.{unique}.1"]))
        scraped = _scraped(server)
        assert 'broker_user_topics{user="orders"} 3.0' in scraped
        assert 'broker_user_groups{user="orders"} 3.0' in scraped
    finally:
        server.stop()


def test_an_owners_journal_cut_short_or_unwritable_fails_no_request_and_no_start(tmp_path, unique) -> None:
    server = _server(tmp_path)
    journal = server.data_dir / "delivery" / "quota-owners.journal"
    try:
        with closing(Client(server.url, user="orders", password="orders")) as orders:
            orders.publish(f"orders.{unique}.0", [OutgoingMessage(b"x")])
        server.stop()
        journal.write_bytes(journal.read_bytes() + b'["topic", "orders.cut')  # a crash mid-line
        server.log.write_text("")
        server.start()
        with closing(Client(server.url, user="orders", password="orders")) as orders:
            orders.publish(f"orders.{unique}.1", [OutgoingMessage(b"x")])  # its line starts a line
            kept = journal.rename(journal.with_suffix(".kept"))
            journal.mkdir()  # the journal cannot be written: the publish that made a topic succeeds
            orders.publish(f"orders.{unique}.2", [OutgoingMessage(b"x")])
            journal.rmdir()
            kept.rename(journal)
        server.stop()
        server.log.write_text("")
        server.start()  # the cut line was not glued to the next
        with closing(Client(server.url, user="orders", password="orders")) as orders:
            orders.publish(f"orders.{unique}.3", [OutgoingMessage(b"x")])  # .2 was not written down
            with pytest.raises(TooManyTopicsError):
                orders.publish(f"orders.{unique}.4", [OutgoingMessage(b"x")])
    finally:
        server.stop()
