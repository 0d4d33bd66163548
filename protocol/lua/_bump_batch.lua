-- #include _layout.lua
-- Count one ended job in its batch, and end the batch when every job has ended. An ended batch's queue leaves
-- its priority's registry (intake stops visiting it) and, once empty, is deleted.
-- status is the job's terminal status, which is also the counter's field name. L: the layout (_layout.lua).
local function bump_batch(L, batch_id, status, now, ttl)
  if not batch_id or batch_id == '' then return end
  local bkey = key(L.batch, batch_id)
  if redis.call('EXISTS', bkey) == 0 then return end
  redis.call('HINCRBY', bkey, status, 1)
  local v = redis.call('HMGET', bkey, 'total', 'finished', 'failed', 'cancelled', 'status', 'queue', 'priority')
  local done = tonumber(v[2] or 0) + tonumber(v[3] or 0) + tonumber(v[4] or 0)
  if done >= tonumber(v[1] or 0) and v[5] ~= 'completed' and v[5] ~= 'cancelled' then
    local final = 'completed'
    if v[5] == 'cancelling' then final = 'cancelled' end
    redis.call('HSET', bkey, 'status', final, 'completed_at', now)
    if v[6] and v[6] ~= '' then
      local p = L.registry[v[7] or ''] and v[7] or L.default_priority
      redis.call('ZREM', L.registry[p], v[6])
      redis.call('ZREM', L.ready[p], v[6])
      if redis.call('XLEN', v[6]) == 0 then redis.call('DEL', v[6]) end
    end
    if ttl and ttl > 0 then
      redis.call('EXPIRE', bkey, ttl)
      redis.call('EXPIRE', key(L.batch_jobs, batch_id), ttl)
    end
  end
end
