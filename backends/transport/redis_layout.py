"""How the Redis Streams transport lays out its data: keys, entries, and the Lua scripts.

Each script is one atomic step on the server, all or nothing under ``maxmemory``:
Redis refuses a script's write with ``OOM`` only while the script has written
nothing, and a write it refuses inside ``redis.pcall`` is raised again at once
(a later write that does not grow memory, an ``XDEL``, would let the rest pass).

Key layout under a namespace ``ns`` (``%s`` below is ``<group>:<topic>``):
``ns:queues:<topic>`` queue count; ``ns:stream:<topic>:<queue>`` the queue
(entry id ``0-<offset + 1>``, so offsets are contiguous from 0; an entry
another program appended above it is adopted: `redis_adoption`);
``ns:head:<topic>:<queue>`` messages appended; ``ns:delayed:<topic>`` (sorted
set of sequence numbers, ``ns:delayed-seq``, by due time) with one hash
``ns:delayed:<topic>:<seq>`` per delayed message;
``ns:inflight:%s`` leases and ``ns:scheduled:%s`` redeliveries (sorted sets
of ``<queue>:<offset>`` by due time); ``ns:state:%s`` the first failure time
a nack stored; ``ns:redelivered:%s`` how often each message was claimed
again (its delivery count less one); ``ns:committed:%s`` the position the
consumer committed per queue; ``ns:joined:%s`` the queues the group has read
(a group missing from one of them was deleted under it: `CLAIM` makes it again
and says so); ``ns:%DLQ%<group>`` the dead-letter stream.
The scripts name keys they build, so they suit a single Redis, not a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backends.errors import TransportError
from backends.transport.base import dead_letter_queue_name
from backends.transport.redis_adoption import ADOPT
from backends.types import Message

# ARGV: ns, topic, then per message: queue, id, key ("-" none, "+key"), headers, payload,
# published_at, due ("" to append it now; else the time it waits in ns:delayed:<topic> until).
# Returns what it adopted (`redis_adoption.ADOPT`). One script for the whole publish: its first
# write is refused out of memory or all of them pass, so no part of it is stored alone.
PUBLISH = ADOPT + """
local ns, topic = ARGV[1], ARGV[2]
local delayed = ns .. ':delayed:' .. topic
for i = 3, #ARGV, 7 do
  local fields = {'id', ARGV[i + 1], 'headers', ARGV[i + 3], 'payload', ARGV[i + 4],
                  'published_at', ARGV[i + 5]}
  if string.sub(ARGV[i + 2], 1, 1) == '+' then
    table.insert(fields, 'key'); table.insert(fields, string.sub(ARGV[i + 2], 2))
  end
  if ARGV[i + 6] == '' then
    append(ns, topic, ARGV[i], fields)
  else
    local seq = string.format('%d', redis.call('INCR', ns .. ':delayed-seq'))
    table.insert(fields, 'queue'); table.insert(fields, ARGV[i])
    redis.call('HSET', delayed .. ':' .. seq, unpack(fields))
    redis.call('ZADD', delayed, ARGV[i + 6], seq)
  end
end
for key, head in pairs(moved) do redis.call('SET', head, heads[key]) end
return adopted
"""

# ARGV: ns, group, topic, queues, now, lease_until, max_messages, first queue
# Returns {claimed, adopted, vanished, recreated}: {member, kind, stored state or false, entry
# fields, redeliveries} per claimed message, what it adopted, the members due again whose entry
# is gone from the stream (dropped, not leased again), and {queue, offset reading resumes from}
# per queue the group was made again on (it had read it, and was deleted since: XGROUP DESTROY,
# the stream deleted). A queue is adopted before it is read.
CLAIM = ADOPT + """
local ns, group, topic = ARGV[1], ARGV[2], ARGV[3]
local queues, now, lease = tonumber(ARGV[4]), ARGV[5], ARGV[6]
local limit, start = tonumber(ARGV[7]), tonumber(ARGV[8])
local base = ':' .. group .. ':' .. topic
local inflight, scheduled, state = ns .. ':inflight' .. base, ns .. ':scheduled' .. base, ns .. ':state' .. base
local redelivered, joined = ns .. ':redelivered' .. base, ns .. ':joined' .. base
local function stream(q) return ns .. ':stream:' .. topic .. ':' .. q end
local recreated = {}

-- the offset a group made on queue q reads first: the stream's first entry, or the next appended
local function first_unread(q)
  local first = redis.call('XRANGE', stream(q), '-', '+', 'COUNT', 1)[1]
  if first then return tonumber(string.match(first[1], '%d+-(%d+)')) - 1 end
  return tonumber(redis.call('GET', ns .. ':head:' .. topic .. ':' .. q) or 0)
end

local delayed = ns .. ':delayed:' .. topic
for _, seq in ipairs(redis.call('ZRANGEBYSCORE', delayed, '-inf', now)) do
  local body = delayed .. ':' .. seq
  local flat, fields, q = redis.call('HGETALL', body), {}, nil
  for j = 1, #flat, 2 do
    if flat[j] == 'queue' then q = flat[j + 1]
    else table.insert(fields, flat[j]); table.insert(fields, flat[j + 1]) end
  end
  append(ns, topic, q, fields)
  redis.call('DEL', body)
  redis.call('ZREM', delayed, seq)
end
for key, head in pairs(moved) do redis.call('SET', head, heads[key]) end

local claimed, vanished = {}, {}
for _, source in ipairs({scheduled, inflight}) do
  if #claimed < limit then
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', source, '-inf', now, 'LIMIT', 0, limit - #claimed)) do
      redis.call('ZREM', source, member)
      local q, offset = string.match(member, '(%d+):(%d+)')
      local id = '0-' .. (tonumber(offset) + 1)
      local entry = redis.call('XRANGE', stream(q), id, id)[1]
      if entry then
        redis.call('ZADD', inflight, lease, member)
        local kind = source == inflight and 'expired' or 'scheduled'
        local again = redis.call('HINCRBY', redelivered, member, 1)
        table.insert(claimed, {member, kind, redis.call('HGET', state, member), entry[2], again})
      else  -- the entry was deleted (DEL, XTRIM, XDEL, FLUSHALL): nothing left to deliver
        redis.call('HDEL', state, member); redis.call('HDEL', redelivered, member)
        table.insert(vanished, member)
      end
    end
  end
end

for pass = 1, 2 do
  for i = 0, queues - 1 do
    local remaining = limit - #claimed
    if remaining <= 0 then return {claimed, adopted, vanished, recreated} end
    local q = (start + i) % queues
    local share = remaining
    if pass == 1 then share = math.ceil(remaining / (queues - i)) end
    local made = redis.pcall('XGROUP', 'CREATE', stream(q), group, '0', 'MKSTREAM')
    -- out of memory (nothing written yet, see `append`): raised before anything is
    if made['err'] and string.sub(made['err'], 1, 3) == 'OOM' then
      redis.call('XGROUP', 'CREATE', stream(q), group, '0', 'MKSTREAM')
    end
    adopt(ns, topic, q)
    if redis.call('HSETNX', joined, q, 1) == 0 and made['ok'] then table.insert(recreated, {q, first_unread(q)}) end
    local read = redis.call('XREADGROUP', 'GROUP', group, 'reliable', 'COUNT', share, 'NOACK',
                            'STREAMS', stream(q), '>')
    if read then
      local leases = {}
      for _, entry in ipairs(read[1][2]) do
        local member = q .. ':' .. (tonumber(string.match(entry[1], '%d+-(%d+)')) - 1)
        table.insert(leases, lease); table.insert(leases, member)
        table.insert(claimed, {member, 'fresh', false, entry[2], 0})
        if #leases >= 2000 then redis.call('ZADD', inflight, unpack(leases)); leases = {} end
      end
      if #leases > 0 then redis.call('ZADD', inflight, unpack(leases)) end
    end
  end
end
return {claimed, adopted, vanished, recreated}
"""

# ARGV: ns, group, topic, member, due_at, state JSON (kept from the first nack).
# Returns 0 if the message is already done.
NACK = """
local base = ':' .. ARGV[2] .. ':' .. ARGV[3]
local inflight, scheduled = ARGV[1] .. ':inflight' .. base, ARGV[1] .. ':scheduled' .. base
if redis.call('ZREM', inflight, ARGV[4]) + redis.call('ZREM', scheduled, ARGV[4]) == 0 then return 0 end
redis.call('ZADD', scheduled, ARGV[5], ARGV[4])
redis.call('HSETNX', ARGV[1] .. ':state' .. base, ARGV[4], ARGV[6])
return 1
"""

# ARGV: ns, group, topic, member, then the dead-letter entry's fields. Returns 0 if already done.
DEAD_LETTER = """
local base = ':' .. ARGV[2] .. ':' .. ARGV[3]
local inflight, scheduled = ARGV[1] .. ':inflight' .. base, ARGV[1] .. ':scheduled' .. base
if redis.call('ZREM', inflight, ARGV[4]) + redis.call('ZREM', scheduled, ARGV[4]) == 0 then return 0 end
redis.call('HDEL', ARGV[1] .. ':state' .. base, ARGV[4])
redis.call('HDEL', ARGV[1] .. ':redelivered' .. base, ARGV[4])
redis.call('XADD', ARGV[1] .. ':%DLQ%' .. ARGV[2], '*', unpack(ARGV, 5))
return 1
"""


class Keys:
    """The key names of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    def queues(self, topic: str) -> str:
        return f"{self.ns}:queues:{topic}"

    def stream(self, topic: str, queue: int) -> str:
        return f"{self.ns}:stream:{topic}:{queue}"

    def head(self, topic: str, queue: int) -> str:
        return f"{self.ns}:head:{topic}:{queue}"

    def delayed(self, topic: str) -> str:
        return f"{self.ns}:delayed:{topic}"

    def group(self, kind: str, group: str, topic: str) -> str:
        """``inflight``, ``scheduled``, ``state``, ``redelivered`` or ``committed`` of a group."""
        return f"{self.ns}:{kind}:{group}:{topic}"

    def dead_letters(self, group: str) -> str:
        return f"{self.ns}:{dead_letter_queue_name(group)}"


def member(queue: int, offset: int) -> str:
    """A message's name in the lease and redelivery sets."""
    return f"{queue}:{offset}"


def position(name: bytes) -> tuple[int, int]:
    """``(queue, offset)`` of a member name."""
    queue, offset = name.split(b":")
    return int(queue), int(offset)


def offset_of(entry_id: bytes) -> int:
    """The offset of stream entry ``0-<offset + 1>``."""
    return int(entry_id.split(b"-")[1]) - 1


def read_and_leased(client: Any, keys: Keys, group: str, topic: str,
                    queues: int) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """``group``'s cursor per queue (never above the head: what it read past it is adopted and read
    again), and the places of its messages in flight."""
    pipe = client.pipeline()
    for queue in range(queues):
        pipe.get(keys.head(topic, queue))
        pipe.xinfo_groups(keys.stream(topic, queue))
    pipe.zrange(keys.group("inflight", group, topic), 0, -1)
    *replies, leased = pipe.execute(raise_on_error=False)
    cursors: dict[int, int] = {}
    for queue, (head, groups) in enumerate(zip(replies[::2], replies[1::2])):
        ours = [g for g in groups if g["name"] == group.encode()] if isinstance(groups, list) else []
        cursors[queue] = min(int(head or 0), offset_of(ours[0]["last-delivered-id"]) + 1) if ours else 0
    return cursors, [position(name) for name in leased]


def entry(
    id_: str, key: str | None, headers: Mapping[str, str], payload: bytes, published_at: float
) -> dict[str, Any]:
    """A message's fields as a stream entry stores them."""
    fields: dict[str, Any] = {"id": id_, "headers": json.dumps(dict(headers)), "payload": payload}
    fields["published_at"] = repr(published_at)
    if key is not None:
        fields["key"] = key
    return fields


def to_message(
    fields: Mapping[str, bytes],
    ref: tuple[str, int, int],
    attempt: int = 1,
    first_failure_at: float | None = None,
) -> Message:
    """A `Message` at ``ref`` (topic, queue, offset) from its entry's ``fields``.

    Another program's ``XADD`` may leave out fields or write bytes that are not
    text: an id falls back to ``topic-queue-offset``, absent headers to none; a
    field that cannot be read marks the message ``unreadable`` (it becomes a
    dead letter naming the field) instead of failing the whole fetch.
    """
    problems: list[str] = []
    key = _text(fields, "key", problems)
    id_ = _text(fields, "id", problems) or "{}-{}-{}".format(*ref)
    headers = _headers(fields.get("headers"), problems)
    published_at = _number(fields.get("published_at"), problems)
    if "payload" not in fields:
        problems.append("the stream entry has no 'payload' field")
    return Message(
        id_,
        *ref,
        fields.get("payload", b""),
        key,
        headers,
        attempt,
        published_at,
        first_failure_at,
        unreadable="; ".join(problems) or None,
    )


def _text(fields: Mapping[str, bytes], name: str, problems: list[str]) -> str | None:
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        problems.append(f"the stream entry's {name!r} field is not UTF-8: {raw[:80]!r}")
        return raw.decode("utf-8", "backslashreplace")


def _headers(raw: bytes | None, problems: list[str]) -> dict[str, str]:
    if raw is None:
        return {}
    try:
        headers = json.loads(raw)
    except ValueError:
        headers = None
    if isinstance(headers, dict) and all(isinstance(value, str) for value in headers.values()):
        return headers
    problems.append(f"the stream entry's 'headers' field is not a JSON object of strings: {raw[:80]!r}")
    return {}


def _number(raw: bytes | None, problems: list[str]) -> float:
    if raw is None:
        return 0.0
    try:
        return float(raw)
    except ValueError:
        problems.append(f"the stream entry's 'published_at' field is not a number: {raw[:80]!r}")
        return 0.0


MAX_BULK_SETTING = "proto-max-bulk-len"
DEFAULT_MAX_BULK = 512 * 1024 * 1024
"""Redis's default ``proto-max-bulk-len``, taken where ``CONFIG GET`` is refused."""


def check_arguments(topic: str, fields: Mapping[str, Any], limit: int) -> None:
    """A `TransportError` for a field of an entry larger than the server's ``proto-max-bulk-len``
    (the key travels as one argument with a character in front)."""
    for name in ("payload", "headers", "key", "id"):
        value = fields.get(name)
        if value is None:
            continue
        size = len(value) if isinstance(value, bytes) else len(value.encode()) + (name == "key")
        if size > limit:
            raise TransportError(
                f"redis: publish to {topic!r}: message {str(fields['id'])[:60]!r}: its {name} takes {size} bytes, "
                f"above the server's {MAX_BULK_SETTING}={limit} (the largest argument Redis reads)")
