"""Lua the worker alone runs (the producer owns submit, cancel and finish). Each one is atomic in Redis, so a
job's record and its stream entry never disagree, whatever crashes between two calls."""

# start: a job leaves the queue for this worker's engine.
# KEYS: record, jobs stream. ARGV: group, entry id, consumer, now, max_attempts.
# Returns {"run", attempts} | {"terminal", status} (entry acked and deleted: nothing to do) |
#         {"missing"} (no record) | {"exhausted", attempts} (the caller dead-letters it).
START = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'missing'}
end
if status == 'finished' or status == 'failed' or status == 'cancelled' then
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[2], ARGV[2])
  return {'terminal', status}
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
if attempts > tonumber(ARGV[5]) then
  return {'exhausted', attempts}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[3], 'started_at', ARGV[4])
redis.call('HDEL', KEYS[1], 'first_token_at')
return {'run', attempts}
"""

# renew: reset the idle time (the lease) of the entries this consumer still owns; report the others as lost
# (reclaimed by another worker after our lease lapsed, or acknowledged already). XCLAIM alone would steal an
# entry back from the worker that reclaimed it, hence the ownership check.
# KEYS: jobs stream. ARGV: group, consumer, entry ids...
RENEW = """
local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2])
  if #pending == 0 then
    table.insert(lost, id)
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
  end
end
return lost
"""

# hand_back: give a job this worker started (and did not finish) back to the queue: the record goes back to
# queued and the entry's idle time jumps past any lease, so the next XAUTOCLAIM of any worker takes it.
# A drain does not count as an attempt; a failed engine step does (a job that keeps crashing the engine
# must reach the dead letters). Only a record this worker runs is touched: a stale worker changes nothing.
# KEYS: record, jobs stream. ARGV: group, consumer, entry id, idle ms, uncount (1/0).
# Returns 1 when the entry was handed back, 0 when this consumer no longer owned it.
HAND_BACK = """
if redis.call('HGET', KEYS[1], 'status') == 'running' and redis.call('HGET', KEYS[1], 'worker') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'status', 'queued')
  redis.call('HDEL', KEYS[1], 'worker', 'started_at', 'first_token_at')
  if ARGV[5] == '1' then
    redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  end
end
local pending = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #pending == 0 then
  return 0
end
redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
return 1
"""
