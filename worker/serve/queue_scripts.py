"""Lua only the worker runs (start, first token and finish are shared with the producer: producer/scripts.py).
Each script is atomic in Redis, so a job's record and its stream entry never disagree, whatever crashes
between two calls."""

# renew: reset the idle time (the lease) of the entries this consumer still owns; report the others as lost
# (reclaimed by another worker after our lease lapsed, or acknowledged already). XCLAIM alone would steal an
# entry back from the worker that reclaimed it, hence the ownership check.
# KEYS: jobs stream. ARGV: group, consumer, entry ids...
RENEW = """
-- KEYS: 1 stream {ns}:jobs. ARGV: 1 group, 2 consumer, 3.. entry ids it holds
-- returns the entry ids it no longer holds (reclaimed by another worker, or acked): the others' idle time is 0
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
-- KEYS: 1 record {ns}:job:{id}, 2 stream {ns}:jobs. ARGV: 1 group, 2 consumer, 3 entry id, 4 idle ms,
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
local pending = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #pending == 0 then
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
