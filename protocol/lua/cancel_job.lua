-- CANCEL_JOB (client)
-- KEYS: 1 record, 2 stream {ns}:events, 3 set {ns}:cancel
-- ARGV: 1 group, 2 job_id, 3 now, 4 default result_ttl, 5 the namespace's layout (JSON, _layout.lua),
--       6 events maxlen
-- returns 'cancelled' (was queued: ended now, entry removed) | 'cancelling' (running: the worker aborts it)
--       | its terminal status (no-op) | '' no such job
-- #include _is_terminal.lua
-- #include _bump_batch.lua
-- #include _queue_depth.lua
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
if cur[2] and cur[5] then
  local M = layout_of_queue(L, cur[5])  -- the depth counter of the entry's model
  depth_init(M)
  ack_del(M, cur[5], ARGV[1], cur[2])
end
bump_batch(L, cur[4], 'cancelled', ARGV[3], ttl)
return 'cancelled'
