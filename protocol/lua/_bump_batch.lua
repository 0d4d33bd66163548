-- #include _layout.lua
-- Count one ended job in its batch, and end the batch when every job has ended. An ended batch's queues (one
-- per model its lines name: the record's `queues`, and its `queue`) leave their priority's registry (intake
-- stops visiting them) and, once empty, are deleted.
-- status is the job's terminal status, which is also the counter's field name. L: the layout (_layout.lua).
local function bump_batch(L, batch_id, status, now, ttl)
  if not batch_id or batch_id == '' then return end
  local bkey = key(L.batch, batch_id)
  if redis.call('EXISTS', bkey) == 0 then return end
  redis.call('HINCRBY', bkey, status, 1)
  local v = redis.call('HMGET', bkey, 'total', 'finished', 'failed', 'cancelled', 'status', 'queue', 'priority',
                       'queues')
  local done = tonumber(v[2] or 0) + tonumber(v[3] or 0) + tonumber(v[4] or 0)
  if done >= tonumber(v[1] or 0) and v[5] ~= 'completed' and v[5] ~= 'cancelled' then
    local final = 'completed'
    if v[5] == 'cancelling' then final = 'cancelled' end
    redis.call('HSET', bkey, 'status', final, 'completed_at', now)
    local queues = {}
    if v[8] and v[8] ~= '' then queues = cjson.decode(v[8]) end
    if v[6] and v[6] ~= '' then table.insert(queues, v[6]) end
    for _, q in ipairs(queues) do
      local M = layout_of_queue(L, q)
      local p = M.registry[v[7] or ''] and v[7] or M.default_priority
      redis.call('ZREM', M.registry[p], q)
      redis.call('ZREM', M.ready[p], q)
      if redis.call('XLEN', q) == 0 then redis.call('DEL', q) end
    end
    if ttl and ttl > 0 then
      redis.call('EXPIRE', bkey, ttl)
      redis.call('EXPIRE', key(L.batch_jobs, batch_id), ttl)
    end
  end
end
