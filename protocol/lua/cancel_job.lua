-- CANCEL_JOB (client)
-- KEYS: 1 record, 2 stream {ns}:events, 3 set {ns}:cancel, 4 the job's token stream {ns}:job:{id}:tokens
--       (a streamed job's final done chunk, _end_stream.lua; optional: without it none is added)
-- ARGV: 1 group, 2 job_id, 3 now, 4 default result_ttl, 5 the namespace's layout (JSON, _layout.lua),
--       6 events maxlen (the MAXLEN ~ of {ns}:events: 100000)
-- returns 'cancelled' (was queued: ended now, entry removed) | 'cancelling' (running: the worker aborts it)
--       | its terminal status (no-op) | '' no such job
-- A queued job's entry is acked and deleted at once (the depth counter counts it): the one its record names,
-- or, for a record without entry_id (a plain submit whose second step has not run: docs/protocol.md,
-- "1. Submit"), the newest entry of the record's queue that names the job (found newest first: it was just
-- written). A queued job that asked for a stream gets its final done chunk.
-- #include _is_terminal.lua
-- #include _bump_batch.lua
-- #include _queue_depth.lua
-- #include _end_stream.lua
local L = cjson.decode(ARGV[5])
local cur = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'result_ttl', 'batch_id', 'queue')
if not cur[1] then return '' end
if is_terminal(cur[1]) then return cur[1] end
if cur[1] == 'running' then
  redis.call('SADD', KEYS[3], ARGV[2])
  return 'cancelling'
end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[3],
           'error', 'cancelled before it started', 'error_code', 'cancelled')
local ttl = tonumber(cur[3] or ARGV[4])
if ttl and ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'job_id', ARGV[2], 'status', 'cancelled')
-- The entry: the one the record names, else the newest of its queue that names the job (see above).
local function entry_of(queue, entry_id, job_id)
  if entry_id then return entry_id, redis.call('XRANGE', queue, entry_id, entry_id)[1] end
  local from = '+'
  while from do
    local page = redis.call('XREVRANGE', queue, from, '-', 'COUNT', 100)
    for _, e in ipairs(page) do
      for i = 1, #e[2], 2 do
        if e[2][i] == 'job_id' and e[2][i + 1] == job_id then return e[1], e end
      end
    end
    from = (#page == 100) and ('(' .. page[#page][1]) or nil
  end
  return nil, nil
end
local request = redis.call('HGET', KEYS[1], 'request')  -- a record that holds its own (an older client)
if cur[5] and redis.call('TYPE', cur[5]).ok == 'stream' then
  local entry_id, entry = entry_of(cur[5], cur[2], ARGV[2])
  for i = 1, entry and #entry[2] or 0, 2 do
    if entry[2][i] == 'request' then request = entry[2][i + 1] end
  end
  if entry_id then
    local M = layout_of_queue(L, cur[5])  -- the depth counter of the entry's model
    depth_init(M)
    ack_del(M, cur[5], ARGV[1], entry_id)
  end
end
end_stream(KEYS[4], request, ttl)
bump_batch(L, cur[4], 'cancelled', ARGV[3], ttl)
return 'cancelled'
