"""Property test: random append / read / lookup / restart / crash sequences against a model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from storetools import segments, small_config

from broker.store import FakeClock, MessageStore, Record

TOPICS = ("a", "b")
KEYS = ("", "k1", "k2")

records = st.builds(
    Record,
    topic=st.sampled_from(TOPICS),
    queue=st.integers(0, 2),
    body=st.binary(max_size=600),
    key=st.sampled_from(KEYS),
    headers=st.dictionaries(st.sampled_from(["x", "y"]), st.text(max_size=5), max_size=2),
    tag=st.sampled_from(["", "red"]),
    message_id=st.one_of(st.just(""), st.uuids().map(str)),
    attempt=st.integers(0, 5),
)


class StoreMachine(RuleBasedStateMachine):
    """The model: per queue, the list of (message id, record) in queue order."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="store-prop-"))
        self.clock = FakeClock()
        self.config = small_config(clock=self.clock, segment_size=4096, max_record_size=2048,
                                   queue_file_entries=4, index_slots=4, index_entries=8,
                                   recent_bytes=3000)  # some appends held in memory, some not
        self.store = MessageStore(self.directory, self.config)
        self.model: dict[tuple[str, int], list[tuple[str, Record]]] = {}
        self.order: list[tuple[tuple[str, int], int, int]] = []  # (place, log offset, size)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule(batch=st.lists(records, min_size=1, max_size=8))
    def append(self, batch: list[Record]) -> None:
        for placed, record in zip(self.store.append(batch), batch, strict=True):
            queue = self.model.setdefault((record.topic, record.queue), [])
            assert placed.queue_offset == len(queue)
            queue.append((placed.message_id, record))
            self.order.append(((record.topic, record.queue), placed.log_offset, placed.size))
        self.clock.advance(1)

    @rule(topic=st.sampled_from(TOPICS), queue=st.integers(0, 2), start=st.integers(0, 30),
          count=st.integers(0, 12))
    def read(self, topic: str, queue: int, start: int, count: int) -> None:
        expected = self.model.get((topic, queue), [])[start : start + count]
        got = self.store.read(topic, queue, start, count)
        assert [(m.message_id, m.body, dict(m.headers), m.key, m.tag, m.attempt) for m in got] == [
            (i, r.body, dict(r.headers), r.key, r.tag, r.attempt) for i, r in expected
        ]

    @rule(topic=st.sampled_from(TOPICS), key=st.sampled_from(KEYS[1:]))
    def lookup_key(self, topic: str, key: str) -> None:
        expected = {i for (t, _), queue in self.model.items() if t == topic
                    for i, r in queue if r.key == key}
        got = self.store.lookup_key(topic, key, 0, self.clock.time() + 1, max_count=10_000)
        assert {m.message_id for m in got} == expected

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def lookup_id(self, data: st.DataObject) -> None:
        place = data.draw(st.sampled_from(sorted(p for p, q in self.model.items() if q)))
        message_id, record = data.draw(st.sampled_from(self.model[place]))
        found = self.store.lookup_id(message_id)
        assert found is not None and found.body == record.body

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = MessageStore(self.directory, self.config)

    @rule()
    def crash(self) -> None:
        self.store._shutdown(clean=False)
        self.store = MessageStore(self.directory, self.config)

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def crash_with_torn_tail(self, data: st.DataObject) -> None:
        place, log_offset, size = self.order[-1]
        last = segments(self.directory)[-1]
        if int(last.stem) > log_offset:
            return  # the last record is not in the last segment file
        self.store._shutdown(clean=False)
        keep = log_offset - int(last.stem) + data.draw(st.integers(0, size - 1))
        with open(last, "r+b") as segment:
            segment.truncate(keep)
        self.order.pop()
        self.model[place].pop()
        self.store = MessageStore(self.directory, self.config)

    @invariant()
    def offsets_match_the_model(self) -> None:
        for (topic, queue), messages in self.model.items():
            assert self.store.max_offset(topic, queue) == len(messages)


StoreMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_store_matches_the_model = StoreMachine.TestCase
