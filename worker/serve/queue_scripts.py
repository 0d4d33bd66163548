"""Lua only the worker runs (start, first token and finish are shared with the producer: producer/scripts.py).
Each script is atomic in Redis, so a job's record and its stream entry never disagree, whatever crashes
between two calls."""

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
local rec = redis.call('HMGET', KEYS[1], 'status', 'worker')
if rec[1] == 'running' and rec[2] == ARGV[2] then
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
