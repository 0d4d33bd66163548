-- HAND_BACK (worker)
-- Give a job this worker started (and did not finish) back to the queue: the record goes back to
-- queued and the entry's idle time jumps past any lease, so the next XAUTOCLAIM of any worker takes it.
-- A drain does not count as an attempt; a failed engine step does (a job that keeps crashing the engine
-- must reach the dead letters). Only a record this worker runs is touched: a stale worker changes nothing.
-- Returns 1 when the entry was handed back, 0 when this consumer no longer owned it (or its queue is gone).
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
