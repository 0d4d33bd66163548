-- READ (worker)
-- The next jobs for this worker's free seats, by priority, then turn by turn over one priority's queues.
-- A priority's queues are its loose queue {ns}:q:{p} and the batch queues in its ready set {ns}:ready:{p}
-- (by first submit): the batch queues that may hold entries nobody has read. Each queue gets an equal share
-- of the seats left (at least one), starting after the queue read last ({ns}:turn:{p}, shared by all
-- workers), and the entries come back interleaved (one of each queue, then the next of each), the order intake
-- admits them in. Only queues up to the seats asked for are visited, so a read costs the same with 1 or 1,000
-- live batches: each visit either reads an entry or finds the queue empty, and an empty batch queue leaves the
-- ready set (the next submit to it puts it back). The entries read count in the depth counter's `pending`.
-- A queue without the consumer group gets it (at 0: nothing in it is skipped) and is read on the next call; a
-- key of another type under a queue's name is left alone.
-- When nothing was read, `wake` names the loose queues and {ns}:wake with the id to wait after (XREAD BLOCK,
-- which consumes nothing): a submit to a loose queue, or one that makes a batch queue ready, wakes the reader;
-- a stream that does not exist yet waits from 0-0, so its first entry wakes the reader too.
-- A worker serving several models' queues (its model's, and the default queues when it serves the default
-- model) reads each priority of every one of them before the next priority: model by model in the order given.
-- KEYS: 1 {ns}:config, only to route the call to the namespace's shard on a Redis Cluster (nothing is read from
--       it; on a single Redis a call with no KEYS works too): the queues are found from the layout
--       (the ready sets change between reads).
-- ARGV: 1 the namespace's layout (JSON, _layout.lua), 2 group, 3 consumer, 4 count (at most this many entries),
--       5 (optional) how many of them to read from the bulk queues before the interactive ones (bulk seats
--       kept, intake.py); bulk is the last of the layout's priorities, 6.. (optional) the ids of the models
--       whose queues to read, '' = the default queues (none given: the default queues alone)
-- returns {entries, wake}: entries = {{queue, entry id, {field, value, ...}}, ...} in admission order;
--         wake = {stream, last id, stream, last id, ...} when entries is empty, else {}: every model's loose
--         queues and wake stream
-- #include _queue_depth.lua
local L, group, consumer = cjson.decode(ARGV[1]), ARGV[2], ARGV[3]
local want = tonumber(ARGV[4])
local bulk_first = math.min(tonumber(ARGV[5] or '0'), want)
local out = {}
local rest = 0
local order_of_priorities = L.priorities
local layouts = {}
for i = 6, #ARGV do table.insert(layouts, model_layout(L, ARGV[i])) end
if #layouts == 0 then layouts = {L} end
for _, M in ipairs(layouts) do depth_init(M) end
if bulk_first > 0 then
  -- bulk jobs short of their reserved seats are read first, up to bulk_first; then the usual order
  order_of_priorities = {L.priorities[#L.priorities]}
  for _, p in ipairs(L.priorities) do table.insert(order_of_priorities, p) end
  rest, want = want - bulk_first, bulk_first
end

-- up to n new entries of q; nogroup: q had no consumer group (made now, read next time)
local function read_q(q, n)
  local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', q, '>')
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'NOGROUP') then
      redis.pcall('XGROUP', 'CREATE', q, group, '0')
      return {}, true
    end
    return {}, false
  elseif type(r) == 'table' and r[1] then
    return r[1][2], false
  end
  return {}, false
end

-- The position in the cycle {loose queue, ready[0], ready[1], ...} after the queue read last.
local function start_after(L, p, ready, last)
  if not last or last == L.queue[p] then return 1 end
  local rank = redis.call('ZRANK', ready, last)
  if rank then return rank + 2 end
  local s = redis.call('ZSCORE', L.registry[p], last)
  if not s then return 0 end
  local before = redis.call('ZCOUNT', ready, '-inf', '(' .. s)
  for _, m in ipairs(redis.call('ZRANGE', ready, s, s, 'BYSCORE')) do
    if m < last then before = before + 1 end
  end
  return before + 1
end

local read_of = {}  -- layout -> entries read from its queues (one HINCRBY of its `pending` at the end)

-- One priority's queues of one model (layout L): its loose queue and its ready batch queues, in turn.
local function read_priority(L, p)
  local ready = L.ready[p]
  local n_cycle = 1 + redis.call('ZCARD', ready)
  local start = start_after(L, p, ready, redis.call('GET', L.turn[p]))
  local window, window_from = {}, -1
  local function at(pos)  -- the queue at a cycle position: ranks are stable (ZREMs wait until the end)
    if pos == 0 then return L.queue[p] end
    local idx = pos - 1
    if window_from < 0 or idx < window_from or idx >= window_from + #window then
      window, window_from = redis.call('ZRANGE', ready, idx, idx + 63), idx
    end
    return window[idx - window_from + 1]
  end
  local got, order, stale, read_here = {}, {}, {}, 0
  local function visit(q, n, still)
    local items, nogroup = read_q(q, n)
    got[q] = got[q] or {}
    for _, it in ipairs(items) do table.insert(got[q], it) end
    want = want - #items
    read_here = read_here + #items
    if #items == n then table.insert(still, q)
    elseif q ~= L.queue[p] and not nogroup then table.insert(stale, q) end
  end
  -- first round: the queues in turn from the position after the last read, until the seats are filled
  local share, still, visited = math.max(1, math.floor(want / n_cycle)), {}, 0
  while want > 0 and visited < n_cycle do
    local q = at((start + visited) % n_cycle)
    visited = visited + 1
    table.insert(order, q)
    visit(q, math.min(share, want), still)
  end
  -- later rounds: the queues that had more than their share
  local active = still
  while want > 0 and #active > 0 do
    local share2, still2 = math.max(1, math.floor(want / #active)), {}
    for _, q in ipairs(active) do
      if want > 0 then visit(q, math.min(share2, want), still2) end
    end
    active = still2
  end
  local i, last_read = 1, nil
  repeat
    local any = false
    for _, q in ipairs(order) do
      local item = got[q] and got[q][i]
      if item then
        table.insert(out, {q, item[1], item[2]})
        any, last_read = true, q
      end
    end
    i = i + 1
  until not any
  if last_read then redis.call('SET', L.turn[p], last_read) end
  if #stale > 0 then redis.call('ZREM', ready, unpack(stale)) end
  read_of[L] = (read_of[L] or 0) + read_here
end

for pi, p in ipairs(order_of_priorities) do
  if bulk_first > 0 and pi == 2 then want = want + rest end
  for _, M in ipairs(layouts) do
    if want > 0 then read_priority(M, p) end
  end
end
for _, M in ipairs(layouts) do
  if (read_of[M] or 0) > 0 then redis.call('HINCRBY', M.depth, 'pending', read_of[M]) end
end

local function last_id(q)
  if redis.call('EXISTS', q) == 1 then
    local info = redis.pcall('XINFO', 'STREAM', q)
    if type(info) == 'table' and not info.err then
      for i = 1, #info, 2 do if info[i] == 'last-generated-id' then return info[i + 1] end end
    end
  end
  return '0-0'
end
local wake = {}
if #out == 0 then
  for _, M in ipairs(layouts) do
    local streams = {}
    for _, p in ipairs(M.priorities) do table.insert(streams, M.queue[p]) end
    table.insert(streams, M.wake)
    for _, q in ipairs(streams) do
      local t = redis.call('TYPE', q).ok
      if t == 'stream' or t == 'none' then
        table.insert(wake, q)
        table.insert(wake, last_id(q))
      end
    end
  end
end
return {out, wake}
