"""Lua only the worker runs (start, first token and finish are shared with the producer: protocol/scripts.py).
Each script is atomic in Redis, so a job's record and its stream entry never disagree, whatever crashes
between two calls."""

# read: the next jobs for this worker's free seats, by priority, then turn by turn over one priority's queues.
# A priority's queues are its loose queue {ns}:q:{p}, the batch queues in its registry {ns}:queues:{p} (by first
# submit) and, for default, the pre-priority stream {ns}:jobs. Each queue gets an equal share of the seats
# left (at least one), starting after the queue read last ({ns}:turn:{p}, shared by all workers), and the
# entries come back interleaved (one of each queue, then the next of each), the order intake admits them in.
# A queue without the consumer group gets it (at 0: nothing in it is skipped) and is read on the next call; a
# key of another type under a queue's name is left alone.
# When nothing was read, `wake` names every queue with the id to wait after (XREAD BLOCK, which consumes
# nothing): a queue that does not exist yet waits from 0-0, so its first entry wakes the reader too.
READ = """
-- KEYS: none: the queues are found from ARGV 1 (the registries can change between a client's reads)
-- ARGV: 1 namespace, 2 group, 3 consumer, 4 count (at most this many entries)
-- returns {entries, wake}: entries = {{queue, entry id, {field, value, ...}}, ...} in admission order;
--         wake = {queue, last id, queue, last id, ...} when entries is empty, else {}
local ns, group, consumer = ARGV[1], ARGV[2], ARGV[3]
local want = tonumber(ARGV[4])
local out, present_all = {}, {}
for _, p in ipairs({'interactive', 'default', 'bulk'}) do
  local qs = {ns .. ':q:' .. p}
  if p == 'default' then table.insert(qs, ns .. ':jobs') end
  for _, q in ipairs(redis.call('ZRANGE', ns .. ':queues:' .. p, 0, -1)) do table.insert(qs, q) end
  local present = {}
  for _, q in ipairs(qs) do
    local t = redis.call('TYPE', q).ok
    if t == 'stream' then table.insert(present, q) end
    if t == 'stream' or t == 'none' then table.insert(present_all, q) end
  end
  if want > 0 and #present > 0 then
    local last, start = redis.call('GET', ns .. ':turn:' .. p), 1
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
    if last_read then redis.call('SET', ns .. ':turn:' .. p, last_read) end
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
"""

# renew: reset the idle time (the lease) of the entries this consumer still owns; report the others as lost
# (reclaimed by another worker after our lease lapsed, acknowledged already, or their queue is gone). XCLAIM
# alone would steal an entry back from the worker that reclaimed it, hence the ownership check.
RENEW = """
-- KEYS: the queue (stream) of each entry: KEYS[i] holds ARGV[i + 2]. ARGV: 1 group, 2 consumer, 3.. entry ids
-- returns the entry ids it no longer holds (reclaimed by another worker, or acked): the others' idle time is 0
local lost = {}
for i = 3, #ARGV do
  local q, id = KEYS[i - 2], ARGV[i]
  local pending = redis.pcall('XPENDING', q, ARGV[1], id, id, 1, ARGV[2])
  if type(pending) ~= 'table' or pending.err or #pending == 0 then
    table.insert(lost, id)
  else
    redis.call('XCLAIM', q, ARGV[1], ARGV[2], 0, id, 'JUSTID')
  end
end
return lost
"""

# hand_back: give a job this worker started (and did not finish) back to the queue: the record goes back to
# queued and the entry's idle time jumps past any lease, so the next XAUTOCLAIM of any worker takes it.
# A drain does not count as an attempt; a failed engine step does (a job that keeps crashing the engine
# must reach the dead letters). Only a record this worker runs is touched: a stale worker changes nothing.
# Returns 1 when the entry was handed back, 0 when this consumer no longer owned it (or its queue is gone).
HAND_BACK = """
-- KEYS: 1 record {ns}:job:{id}, 2 the entry's queue (stream). ARGV: 1 group, 2 consumer, 3 entry id, 4 idle ms,
--       5 uncount ('1': the attempt does not count, a drain; '0': it does, a failed step)
-- returns 1 handed back (record queued again if this consumer ran it; entry idle past every lease) | 0 not ours
local rec = redis.call('HMGET', KEYS[1], 'status', 'worker')
if rec[1] == 'running' and rec[2] == ARGV[2] then
  redis.call('HSET', KEYS[1], 'status', 'queued')
  redis.call('HDEL', KEYS[1], 'worker', 'started_at', 'first_token_at')
  if ARGV[5] == '1' then
    redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  end
end
local pending = redis.pcall('XPENDING', KEYS[2], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if type(pending) ~= 'table' or pending.err or #pending == 0 then
  return 0
end
redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
return 1
"""

# publish_tokens: one chunk of a streaming job's output. The token stream expires with the job record: EXPIRE
# by the record's result_ttl (0 = kept, like the record), the worker's own result_ttl_s only for a record
# written without one. Nothing is written once the record is gone (expired, or deleted).
PUBLISH_TOKENS = """
-- KEYS: 1 token stream {ns}:job:{id}:tokens, 2 record {ns}:job:{id}
-- ARGV: 1 offset, 2 token ids (JSON list), 3 text, 4 done (1 on the last chunk, else 0),
--       5 default ttl (seconds, for a record without result_ttl)
-- returns the chunk's entry id | false: no record, nothing written
if redis.call('EXISTS', KEYS[2]) == 0 then return false end
local id = redis.call('XADD', KEYS[1], '*', 'offset', ARGV[1], 'token_ids', ARGV[2], 'text', ARGV[3],
                      'done', ARGV[4])
local ttl = tonumber(redis.call('HGET', KEYS[2], 'result_ttl') or ARGV[5])
if ttl and ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
return id
"""
