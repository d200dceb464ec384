"""Entries another program appended to a Redis Streams queue with ids of its own.

The transport numbers a queue's entries ``0-<offset + 1>``, and its head
counter says how many it holds. Another program's natural ``XADD <stream> *``
(or any explicit id) lands above ``0-<head>``: left there, every later
``XADD 0-<head + 1>`` is refused (the id is below the stream's top) and a
group that read it would have its cursor moved past every later offset.

So the scripts that append to or read a queue *adopt* such entries first,
in the same atomic step: delete them, set the stream's last id back to
``0-<head>`` and append their fields again at the next offsets, in arrival
order; then they are messages like any other. On the normal path an append
costs nothing more (Redis refusing its ``XADD`` is the sign to adopt) and a
read costs one ``XREVRANGE`` bounded below by ``0-<head>`` that finds
nothing, per queue. A group cursor found above ``0-<head>`` (a reader that
did not adopt first, such as this transport before it did) is moved back
to ``0-<head>``: the adopted entries are delivered again, never skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# Lua prelude of the scripts that append to or read a queue (two closures only: each costs
# every call of the script). ``heads[q]``: a queue's head as this script knows it;
# ``adopt`` returns it once nothing lies above ``0-<head>`` (checked once per queue per
# script); ``append`` adds an entry at the next offset (the script then stores the heads
# in ``moved``). ``adopted`` holds one record per adoption for the caller's log: {queue,
# first new offset, count, first id, last id, groups rewound}.
ADOPT = """
local heads, checked, moved, adopted = {}, {}, {}, {}

-- force: adopt even if the check finds nothing above 0-<head> (an append was refused).
local function adopt(ns, topic, q, force)
  local key, stream, head = tostring(q), ns .. ':stream:' .. topic .. ':' .. q, ns .. ':head:' .. topic .. ':' .. q
  local n = heads[key] or tonumber(redis.call('GET', head) or '0')
  heads[key] = n
  if not force and (checked[key] or #redis.call('XREVRANGE', stream, '+', '(0-' .. n, 'COUNT', 1) == 0) then
    checked[key] = true
    return n
  end
  checked[key] = true
  local foreign = redis.call('XRANGE', stream, '(0-' .. n, '+')
  for _, entry in ipairs(foreign) do redis.call('XDEL', stream, entry[1]) end
  -- the last id back to 0-<n>, Redis counting only the layout's entries and recording the
  -- deletion just above them (MAXDELETEDID 0-0 it would ignore); then any cursor above it
  local setid = {'XSETID', stream, '0-' .. n, 'ENTRIESADDED', math.max(n, redis.call('XLEN', stream))}
  if n > 0 then table.insert(setid, 'MAXDELETEDID'); table.insert(setid, '0-' .. n) end
  redis.call(unpack(setid))
  local rewound = {}
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local group = {}
    for j = 1, #info, 2 do group[info[j]] = info[j + 1] end
    local ms, seq = string.match(group['last-delivered-id'], '^(%d+)-(%d+)$')
    if ms ~= '0' or tonumber(seq) > n then
      redis.call('XGROUP', 'SETID', stream, group['name'], '0-' .. n)
      table.insert(rewound, group['name'])
    end
  end
  for i, entry in ipairs(foreign) do redis.call('XADD', stream, '0-' .. (n + i), unpack(entry[2])) end
  local first, last = foreign[1] or {''}, foreign[#foreign] or {''}
  table.insert(adopted, {key, n, #foreign, first[1], last[1], rewound})
  heads[key] = n + #foreign
  redis.call('SET', head, heads[key])
  return heads[key]
end

local function append(ns, topic, q, fields)
  local key, stream = tostring(q), ns .. ':stream:' .. topic .. ':' .. q
  if not moved[key] then
    moved[key] = ns .. ':head:' .. topic .. ':' .. q
    heads[key] = heads[key] or tonumber(redis.call('GET', moved[key]) or '0')
  end
  local n = heads[key] + 1
  local reply = redis.pcall('XADD', stream, '0-' .. n, unpack(fields))
  if type(reply) == 'table' and reply.err then
    -- out of memory: Redis refuses a script's writes only while it has written nothing, so
    -- the XADD again raises OOM with nothing changed (adopting would write on, half way)
    if string.sub(reply.err, 1, 3) == 'OOM' then redis.call('XADD', stream, '0-' .. n, unpack(fields)) end
    -- refused: an entry lies above 0-<head> (or lay: deleted, its id is still the top).
    -- Any other error comes back from the XADD below.
    n = adopt(ns, topic, q, true) + 1
    redis.call('XADD', stream, '0-' .. n, unpack(fields))
  end
  heads[key] = n
  return n
end
"""


def log_adopted(topic: str, records: Sequence[Any]) -> None:
    """Log what a script adopted (``ADOPT``'s records): count 0 means it only reset the last id."""
    for queue, head, count, first_id, last_id, rewound in records:
        log.info(
            "transport.foreign_entries_adopted",
            topic=topic,
            queue=int(queue),
            offset=int(head),
            count=int(count),
            first_id=first_id.decode(),
            last_id=last_id.decode(),
        )
        for group in rewound:
            log.warning(
                "transport.group_cursor_rewound",
                topic=topic,
                queue=int(queue),
                group=group.decode("utf-8", "replace"),
                offset=int(head),
            )


def foreign_on_top(top: Sequence[Any], head: int) -> bool:
    """Whether the top entry of a queue (``XREVRANGE ... COUNT 1``) lies above ``0-<head>``."""
    if not top:
        return False
    ms, seq = top[0][0].split(b"-")
    return int(ms) > 0 or int(seq) > head
