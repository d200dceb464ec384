"""The `Cache` contract, run against every backend: memory and the real Redis."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from backends.cache import Cache, MemoryCache, open_cache
from backends.cache.memory import SWEEP_STEP
from backends.cache.redis import RedisCache
from backends.clock import FakeClock
from backends.errors import CacheUnavailableError, ConfigurationError, UnsupportedURLError
from tests.waiting import wait_until

TTL = 3600.0


def wait_until_forgotten(cache: Cache, namespace: str, token: str, fake_clock: FakeClock) -> None:
    """Let a short TTL pass: the fake clock for memory, real (polled) time for Redis."""
    fake_clock.advance(1.0)
    wait_until(lambda: not cache.seen(namespace, [token]), f"token {token!r} forgotten", 5)


class TestCache:
    def test_remembered_tokens_are_seen(self, cache: Cache, unique: str) -> None:
        assert cache.seen(unique, ["a", "b"]) == set()
        cache.remember(unique, ["a", "b", "a"], TTL)
        assert cache.seen(unique, ["a", "b", "c", "a"]) == {"a", "b"}
        assert cache.seen(unique, []) == set()

    def test_namespaces_are_independent(self, cache: Cache, unique: str) -> None:
        cache.remember(unique, ["a"], TTL)
        assert cache.seen(unique + "-other", ["a"]) == set()

    def test_forget(self, cache: Cache, unique: str) -> None:
        cache.remember(unique, ["a", "b"], TTL)
        cache.forget(unique, ["a", "never-there"])
        assert cache.seen(unique, ["a", "b"]) == {"b"}

    def test_tokens_expire_after_their_ttl(
        self, cache: Cache, unique: str, fake_clock: FakeClock
    ) -> None:
        cache.remember(unique, ["short"], 0.05)
        cache.remember(unique, ["long"], TTL)
        wait_until_forgotten(cache, unique, "short", fake_clock)
        assert cache.seen(unique, ["short", "long"]) == {"long"}

    def test_remember_again_extends_the_ttl(
        self, cache: Cache, unique: str, fake_clock: FakeClock
    ) -> None:
        cache.remember(unique, ["a"], 0.05)
        cache.remember(unique, ["a"], TTL)
        fake_clock.advance(1.0)
        if isinstance(cache, RedisCache):
            time.sleep(0.1)  # past the first, short TTL on the server's clock
        assert cache.seen(unique, ["a"]) == {"a"}

    def test_tokens_with_separators_and_unicode(self, cache: Cache, unique: str) -> None:
        odd = ["a:b", "ç/é", " spaced ", "x" * 300]
        cache.remember(unique, odd, TTL)
        assert cache.seen(unique, odd + ["a"]) == set(odd)

    def test_threads_share_one_cache(self, cache: Cache, unique: str) -> None:
        def work(worker: int) -> None:
            mine = [f"{worker}-{i}" for i in range(50)]
            cache.remember(unique, mine, TTL)
            assert cache.seen(unique, mine) == set(mine)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        every = [f"{w}-{i}" for w in range(8) for i in range(50)]
        assert cache.seen(unique, every) == set(every)


class TestMemoryCache:
    def test_least_recently_used_is_evicted(self, fake_clock: FakeClock, unique: str) -> None:
        cache = open_cache("memory://?max_entries=3", clock=fake_clock)
        cache.remember(unique, ["a", "b", "c"], TTL)
        assert cache.seen(unique, ["a"]) == {"a"}  # "a" is now the most recent
        cache.remember(unique, ["d"], TTL)
        assert cache.seen(unique, ["a", "b", "c", "d"]) == {"a", "c", "d"}
        assert isinstance(cache, MemoryCache) and len(cache) == 3

    def test_expiry_is_exact_on_the_injected_clock(
        self, fake_clock: FakeClock, unique: str
    ) -> None:
        cache = open_cache("memory://", clock=fake_clock)
        cache.remember(unique, ["a"], 10)
        fake_clock.advance(9.9)
        assert cache.seen(unique, ["a"]) == {"a"}
        fake_clock.advance(0.1)
        assert cache.seen(unique, ["a"]) == set()

    def test_expired_tokens_are_dropped_without_being_read(self, fake_clock: FakeClock, unique: str) -> None:
        """A token a second for 2,000 seconds, each living 10 and none read again: the old cache
        held all 2,000 (its LRU bound is 100,000), 1,990 of them expired; now the 10 alive and the
        one that expired in the last second (an entry goes once its whole expiry second is past)."""
        cache = MemoryCache(clock=fake_clock)
        for n in range(2000):
            cache.remember(unique, [f"t{n}"], 10)
            fake_clock.advance(1.0)
        assert len(cache) == 11
        assert cache.seen(unique, ["t1989", "t1990", "t1991", "t1999"]) == {"t1991", "t1999"}

    def test_a_burst_of_expired_tokens_is_dropped_by_the_next_calls(
        self, fake_clock: FakeClock, unique: str
    ) -> None:
        """1,000 tokens remembered at once expire together; lookups of other tokens drop them, a
        bounded number per call (`SWEEP_STEP` more than the tokens named), however many are due."""
        cache = MemoryCache(clock=fake_clock)
        cache.remember(unique, [f"t{n}" for n in range(1000)], 10)
        fake_clock.advance(11)
        assert cache.seen(unique, ["other"]) == set()
        assert len(cache) == 1000 - (SWEEP_STEP + 1)
        for _ in range(1000 // (SWEEP_STEP + 1)):
            cache.seen(unique, ["other"])
        assert len(cache) == 0

    def test_entries_leave_their_expiry_bucket_when_forgotten_evicted_or_remembered_again(
        self, fake_clock: FakeClock, unique: str
    ) -> None:
        """Each entry is filed under its expiry second; one forgotten, evicted, read expired or
        remembered again leaves its old place, so the buckets hold exactly the entries."""
        cache = MemoryCache(max_entries=50, clock=fake_clock)
        for n in range(200):
            cache.remember(unique, [f"t{n}", "again"], 5 + n % 7)
            fake_clock.advance(0.25)
        cache.forget(unique, [f"t{n}" for n in range(190, 195)])
        fake_clock.advance(6)
        cache.seen(unique, [f"t{n}" for n in range(195, 200)])
        cache.remember(unique, ["for ever"], float("inf"))
        filed = [key for bucket in cache._buckets.values() for key in bucket]  # private: no public view
        assert sorted(filed) == sorted(cache._expiry)
        fake_clock.advance(TTL)
        assert cache.seen(unique, ["other", "for ever"]) == {"for ever"}
        assert list(cache._buckets.values()) == [{(unique, "for ever")}]

    @pytest.mark.parametrize("query", ["max_entries=0", "max_entries=many", "size=3"])
    def test_bad_options_are_named(self, query: str) -> None:
        with pytest.raises(ConfigurationError, match="memory://"):
            open_cache(f"memory://?{query}")


class TestRedisCache:
    def test_keys_and_ttl_on_the_server(self, redis_url: str, unique: str) -> None:
        cache = open_cache(redis_url)
        cache.remember(unique, ["a"], 1)
        client = redis.Redis.from_url(redis_url)
        remaining = client.pttl(f"reliable:{unique}:a")
        assert 0 < remaining <= 1000
        client.close()
        cache.close()

    def test_one_round_trip_per_call(
        self, redis_url: str, unique: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cache = open_cache(redis_url)
        cache.seen(unique, ["warm-up"])  # the connection handshake is not a call's round trip
        sent: list[Any] = []
        original = redis.connection.Connection.send_packed_command

        def counting(self: Any, command: Any, check_health: bool = True) -> None:
            sent.append(command)
            original(self, command, check_health)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
        tokens = [f"t{i}" for i in range(500)]
        cache.remember(unique, tokens, TTL)
        assert len(sent) == 1
        assert cache.seen(unique, tokens) == set(tokens)
        assert len(sent) == 2
        cache.close()

    @pytest.mark.parametrize("operation", ["seen", "remember", "forget"])
    def test_outage_is_cache_unavailable(self, operation: str) -> None:
        cache = open_cache("redis://127.0.0.1:1/0")
        call = {
            "seen": lambda: cache.seen("group", ["a"]),
            "remember": lambda: cache.remember("group", ["a"], TTL),
            "forget": lambda: cache.forget("group", ["a"]),
        }[operation]
        with pytest.raises(CacheUnavailableError) as raised:
            call()
        assert isinstance(raised.value.__cause__, redis.RedisError)

    def test_rediss_is_accepted_without_connecting(self) -> None:
        assert isinstance(open_cache("rediss://127.0.0.1:1/0"), RedisCache)


@pytest.mark.parametrize("url", ["memcached://127.0.0.1", "http://x", "nothing"])
def test_unknown_scheme_names_url_and_allowed(url: str) -> None:
    with pytest.raises(UnsupportedURLError) as raised:
        open_cache(url)
    assert url in str(raised.value) and "redis" in str(raised.value)


def test_two_deployments_sharing_one_redis_keep_apart_by_prefix(redis_url, unique):
    from backends.cache import open_cache

    eu, us = open_cache(redis_url, prefix=f"eu-{unique}"), open_cache(redis_url, prefix=f"us-{unique}")
    eu.remember("billing", ["t1"], 60)
    assert eu.seen("billing", ["t1"]) == {"t1"}
    assert us.seen("billing", ["t1"]) == set()  # same group, same token: another deployment's
