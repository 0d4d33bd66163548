-- START_JOB (worker)
-- KEYS: 1 record, 2 the queue (stream) the entry was read from
-- ARGV: 1 group, 2 entry_id, 3 worker name, 4 now, 5 the namespace's layout (JSON, _layout.lua: the depth counter),
--       6 (optional) the retry backoff 'base_ms,max_ms,jitter' (jitter in [0, 1); '' = none), 7 lease ms,
--       8 the consumer a deferred entry waits under (not the worker's own: it holds no seat of it)
-- returns {'running', attempts} (run it) | {status, 0} terminal: skip (entry acked+deleted)
--       | {'missing', 0} no record (expired or never submitted): skip (entry acked+deleted)
--       | {'deferred', ms} its retry is not due for ms: the entry stays pending (under ARGV 8), claimable again
--         by any worker's XAUTOCLAIM when it is due
-- A record still `running` (its worker stopped and its lease lapsed) or queued with attempts > 0 (handed back
-- after a failed step) had a transient fault: with a backoff, its next attempt is not before
-- now + min(max, base x 2^(attempts-1)) x (0.5 + jitter/2), set once per attempt (`backoff_attempt`), so a
-- repeated call changes nothing; until then every worker's start defers it.
-- #include _is_terminal.lua
-- #include _queue_depth.lua
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or is_terminal(status) then
  local M = layout_of_queue(cjson.decode(ARGV[5]), KEYS[2])  -- the depth counter of the entry's model
  depth_init(M)
  ack_del(M, KEYS[2], ARGV[1], ARGV[2])
  return {status or 'missing', 0}
end
local rec = redis.call('HMGET', KEYS[1], 'attempts', 'not_before', 'backoff_attempt')
local now, attempts, not_before = tonumber(ARGV[4]), tonumber(rec[1] or 0), tonumber(rec[2] or 0)
local faulted = status == 'running' or (status == 'queued' and attempts > 0)
if faulted and ARGV[6] and ARGV[6] ~= '' and tonumber(rec[3] or -1) ~= attempts then
  local base, max, jitter = string.match(ARGV[6], '([^,]+),([^,]+),([^,]+)')
  local delay = math.min(tonumber(max), tonumber(base) * 2 ^ (attempts - 1)) * (0.5 + tonumber(jitter) / 2)
  not_before = now + delay / 1000
  redis.call('HSET', KEYS[1], 'status', 'queued', 'not_before', tostring(not_before), 'backoff_attempt', attempts)
  redis.call('HDEL', KEYS[1], 'worker', 'first_token_at')
end
if not_before > now then
  local remaining = math.ceil((not_before - now) * 1000)
  -- idle set so that XAUTOCLAIM (min idle = the lease) takes the entry again when the retry is due
  local idle = math.max(0, tonumber(ARGV[7] or 0) - remaining)
  redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[8] or ARGV[3], 0, ARGV[2], 'IDLE', idle, 'JUSTID')
  return {'deferred', remaining}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[4], 'worker', ARGV[3],
           'entry_id', ARGV[2], 'queue', KEYS[2])
redis.call('HDEL', KEYS[1], 'first_token_at')
return {'running', redis.call('HINCRBY', KEYS[1], 'attempts', 1)}
