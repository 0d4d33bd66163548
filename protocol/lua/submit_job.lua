-- SUBMIT_JOB (client)
-- KEYS: 1 record {ns}:job:{id}, 2 queue {ns}:q:{priority} (loose) or {ns}:q:{priority}:{batch_id} (a batch's),
--       3 registry {ns}:queues:{priority}
-- ARGV: 1 job_id, 2 request JSON, 3 now, 4 max_queue_len (0 = no limit; the depth counter, every queue), 5 result_ttl,
--       6 batch_id ('' = none), 7 custom_id ('' = none), 8 priority, 9 the namespace's layout (JSON, _layout.lua),
--       10 consumer group
-- returns {1, entry_id} queued | {0, status} already exists (idempotent) | {-1, depth} queue full
--       | {-2, its batch_id} a batch job (ARGV 6 set) whose id is taken by a job outside that batch
--       | an error reply: a priority not in the layout, or KEYS 2-3 not its queue and registry
-- Any existing key refuses the submit (EXISTS, not HGET status): a job is never reset or overwritten.
-- The request is written once, into the queue entry; the record gets it when the job ends (_keep_request.lua).
-- The record holds only short fields (a compact listpack hash), none that its key or its entry already holds:
-- no `id` (its key names it), no `request`, no `attempts` until a worker starts it (absent = 0).
-- A new queue gets the consumer group; a batch queue joins its priority's registry and, when it was not there
-- already, its ready set (intake reads from there; an entry in {ns}:wake wakes idle workers). The depth counter
-- counts the entry (_queue_depth.lua).
-- #include _queue_depth.lua
local L = cjson.decode(ARGV[9])
local prio = ARGV[8]
if not L.queue[prio] then
  return redis.error_reply('ERR submit: priority must be one of ' .. table.concat(L.priorities, ', ') ..
                           ', got ' .. prio)
end
local queue = L.queue[prio]
if ARGV[6] ~= '' then queue = key(L.batch_queue[prio], ARGV[6]) end
if KEYS[2] ~= queue or KEYS[3] ~= L.registry[prio] then
  return redis.error_reply('ERR submit: KEYS[2] must be ' .. queue .. ' and KEYS[3] ' .. L.registry[prio])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = redis.call('HMGET', KEYS[1], 'status', 'batch_id')
  if ARGV[6] ~= '' and cur[2] ~= ARGV[6] then return {-2, cur[2] or ''} end
  return {0, cur[1] or ''}
end
local limit = tonumber(ARGV[4])
local depth = queue_depth(L)  -- O(1): the counter, not a sum over the queues
if limit > 0 and depth >= limit then return {-1, tostring(depth)} end
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('XGROUP', 'CREATE', KEYS[2], ARGV[10], '0', 'MKSTREAM') end
local entry = redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[1], 'request', ARGV[2])
redis.call('HINCRBY', L.depth, prio, 1)
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[3], 'NX', ARGV[3], KEYS[2])
  if redis.call('ZADD', L.ready[prio], 'NX', redis.call('ZSCORE', KEYS[3], KEYS[2]), KEYS[2]) == 1 then
    redis.call('XADD', L.wake, 'MAXLEN', '~', 100, '*', 'queue', KEYS[2])
  end
end
redis.call('HSET', KEYS[1], 'status', 'queued', 'created_at', ARGV[3], 'result_ttl', ARGV[5], 'entry_id', entry,
           'queue', KEYS[2], 'priority', prio)
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'batch_id', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'custom_id', ARGV[7]) end
return {1, entry}
