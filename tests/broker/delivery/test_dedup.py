"""The de-duplication window: ids found for ``window`` seconds unless ``entries`` came after them."""

from __future__ import annotations

from broker.delivery.dedup import DedupWindow
from broker.delivery.values import Placement
from broker.store import FakeClock


def test_an_id_is_found_within_the_window_on_its_topic_only() -> None:
    clock = FakeClock(1000.0)
    window = DedupWindow(clock, window=60.0, entries=100)
    window.add("orders", [1, 2], [10, 20], ["a", "b"])
    assert window.find("orders", ["b", "c", "a"]) == [
        Placement("orders", 2, 20, "b"), None, Placement("orders", 1, 10, "a")]
    assert window.get("payments", "a") is None
    clock.advance(59.0)
    window.add("orders", [0], [0], ["c"])
    clock.advance(1.0)
    assert window.get("orders", "a") == Placement("orders", 1, 10, "a")
    window.add("orders", [0], [1], ["d"])  # a generation began: a, b, c are the previous one
    assert window.find("orders", ["a", "c", "d"]) == [
        Placement("orders", 1, 10, "a"), Placement("orders", 0, 0, "c"), Placement("orders", 0, 1, "d")]
    clock.advance(0.5)
    assert window.find("orders", ["a", "b", "c"]) == [None, None, Placement("orders", 0, 0, "c")]


def test_ids_are_kept_until_entries_more_came_after_them() -> None:
    window = DedupWindow(FakeClock(0.0), window=60.0, entries=3)
    window.add("t", [0, 0], [0, 1], ["a", "b"])
    window.add("t", [0, 0], [2, 3], ["c", "d"])  # 4 held: the next add starts a generation
    window.add("t", [0, 0, 0], [4, 5, 6], ["e", "f", "g"])
    assert all(window.find("t", ["a", "b", "c", "d", "e", "f", "g"]))
    window.add("t", [0], [7], ["h"])  # a, b, c, d had 3 after them: dropped
    assert window.find("t", ["a", "d", "e", "h"]) == [
        None, None, Placement("t", 0, 4, "e"), Placement("t", 0, 7, "h")]


def test_an_id_published_again_after_its_window_is_found_at_its_new_place() -> None:
    clock = FakeClock(0.0)
    window = DedupWindow(clock, window=10.0, entries=100)
    window.add("t", [0], [0], ["a"])
    clock.advance(11.0)
    assert window.get("t", "a") is None
    window.add("t", [1], [7], ["a"])
    assert window.get("t", "a") == Placement("t", 1, 7, "a")
