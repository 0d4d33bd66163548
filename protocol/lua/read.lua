-- READ (worker)
-- The next jobs for this worker's free seats, by priority, then turn by turn over one priority's queues.
-- A priority's queues are its loose queue {ns}:q:{p} and the batch queues in its registry {ns}:queues:{p} (by
-- first submit). Each queue gets an equal share of the seats
-- left (at least one), starting after the queue read last ({ns}:turn:{p}, shared by all workers), and the
-- entries come back interleaved (one of each queue, then the next of each), the order intake admits them in.
-- A queue without the consumer group gets it (at 0: nothing in it is skipped) and is read on the next call; a
-- key of another type under a queue's name is left alone.
-- When nothing was read, `wake` names every queue with the id to wait after (XREAD BLOCK, which consumes
-- nothing): a queue that does not exist yet waits from 0-0, so its first entry wakes the reader too.
-- KEYS: none: the queues are found from the layout (the registries can change between a client's reads)
-- ARGV: 1 the namespace's layout (JSON, _layout.lua), 2 group, 3 consumer, 4 count (at most this many entries),
--       5 (optional) how many of them to read from the bulk queues before the interactive ones (bulk seats
--       kept, intake.py); bulk is the last of the layout's priorities
-- returns {entries, wake}: entries = {{queue, entry id, {field, value, ...}}, ...} in admission order;
--         wake = {queue, last id, queue, last id, ...} when entries is empty, else {}
local L, group, consumer = cjson.decode(ARGV[1]), ARGV[2], ARGV[3]
local want = tonumber(ARGV[4])
local bulk_first = math.min(tonumber(ARGV[5] or '0'), want)
local out, present_all = {}, {}
local rest = 0
local order_of_priorities = L.priorities
if bulk_first > 0 then
  -- bulk jobs short of their reserved seats are read first, up to bulk_first; then the usual order
  order_of_priorities = {L.priorities[#L.priorities]}
  for _, p in ipairs(L.priorities) do table.insert(order_of_priorities, p) end
  rest, want = want - bulk_first, bulk_first
end
for pi, p in ipairs(order_of_priorities) do
  if bulk_first > 0 and pi == 2 then want = want + rest end
  local qs = {L.queue[p]}
  for _, q in ipairs(redis.call('ZRANGE', L.registry[p], 0, -1)) do table.insert(qs, q) end
  local present = {}
  for _, q in ipairs(qs) do
    local t = redis.call('TYPE', q).ok
    if t == 'stream' then table.insert(present, q) end
    if t == 'stream' or t == 'none' then table.insert(present_all, q) end
  end
  if want > 0 and #present > 0 then
    local last, start = redis.call('GET', L.turn[p]), 1
    for i, q in ipairs(present) do if q == last then start = i + 1 end end
    local order = {}
    for i = 0, #present - 1 do order[i + 1] = present[((start - 1 + i) % #present) + 1] end
    local got, active = {}, order
    while want > 0 and #active > 0 do
      local share, still = math.max(1, math.floor(want / #active)), {}
      for _, q in ipairs(active) do
        if want > 0 then
          local n = math.min(share, want)
          local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', q, '>')
          local items = {}
          if type(r) == 'table' and r.err then
            if string.find(r.err, 'NOGROUP') then redis.pcall('XGROUP', 'CREATE', q, group, '0') end
          elseif type(r) == 'table' and r[1] then
            items = r[1][2]
          end
          got[q] = got[q] or {}
          for _, it in ipairs(items) do table.insert(got[q], it) end
          want = want - #items
          if #items == n then table.insert(still, q) end
        end
      end
      active = still
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
  end
end
local wake = {}
if #out == 0 then
  for _, q in ipairs(present_all) do
    local last = '0-0'
    if redis.call('EXISTS', q) == 1 then
      local info = redis.pcall('XINFO', 'STREAM', q)
      if type(info) == 'table' and not info.err then
        for i = 1, #info, 2 do if info[i] == 'last-generated-id' then last = info[i + 1] end end
      end
    end
    table.insert(wake, q)
    table.insert(wake, last)
  end
end
return {out, wake}
