-- #include _queue_depth.lua
-- Write jobs to one queue: the body of SUBMIT_JOB (one job) and of SUBMIT_JOBS (many jobs of one queue in one
-- call, so what is the same for each, the layout's decoding, the depth read, the queue's registry and ready
-- entries and the depth counter's HINCRBY, is done once a call instead of once a job).
-- job(i) -> record key, job_id, request JSON, custom_id ('' = none) of the i-th of n jobs.
-- Returns a table of n replies ({1, entry_id} | {0, status} | {-1, depth} | {-2, batch_id}: SUBMIT_JOB's), or
-- an error reply for a priority not in the layout or KEYS that are not its queue and registry.
-- Any existing key refuses that job (EXISTS, not HGET status): a job is never reset or overwritten.
local function submit_jobs(L, qkey, rkey, prio, batch_id, now, limit, ttl, group, n, job)
  if not L.queue[prio] then
    return redis.error_reply('ERR submit: priority must be one of ' .. table.concat(L.priorities, ', ') ..
                             ', got ' .. prio)
  end
  local queue = L.queue[prio]
  if batch_id ~= '' then queue = key(L.batch_queue[prio], batch_id) end
  if qkey ~= queue or rkey ~= L.registry[prio] then
    return redis.error_reply('ERR submit: the queue and registry KEYS must be ' .. queue .. ' and ' ..
                             L.registry[prio])
  end
  local out, added, depth, made = {}, 0, nil, false
  for i = 1, n do
    local record, job_id, request, custom_id = job(i)
    if redis.call('EXISTS', record) == 1 then
      local cur = redis.call('HMGET', record, 'status', 'batch_id')
      if batch_id ~= '' and cur[2] ~= batch_id then out[i] = {-2, cur[2] or ''} else out[i] = {0, cur[1] or ''} end
    else
      if depth == nil then depth = queue_depth(L) end  -- O(1): the counter, not a sum over the queues
      if limit > 0 and depth + added >= limit then
        out[i] = {-1, tostring(depth + added)}
      else
        if not made then
          if redis.call('EXISTS', qkey) == 0 then redis.call('XGROUP', 'CREATE', qkey, group, '0', 'MKSTREAM') end
          made = true
        end
        local entry = redis.call('XADD', qkey, '*', 'job_id', job_id, 'request', request)
        -- one HSET, fields in the order the record always had (its listpack reads the same)
        local f = {'status', 'queued', 'created_at', now, 'result_ttl', ttl, 'entry_id', entry, 'queue', qkey,
                   'priority', prio}
        local m = 12
        if batch_id ~= '' then f[m + 1], f[m + 2], m = 'batch_id', batch_id, m + 2 end
        if custom_id ~= '' then f[m + 1], f[m + 2] = 'custom_id', custom_id end
        redis.call('HSET', record, unpack(f))
        added = added + 1
        out[i] = {1, entry}
      end
    end
  end
  if added > 0 then
    redis.call('HINCRBY', L.depth, prio, added)
    if batch_id ~= '' then
      redis.call('ZADD', rkey, 'NX', now, qkey)
      if redis.call('ZADD', L.ready[prio], 'NX', redis.call('ZSCORE', rkey, qkey), qkey) == 1 then
        redis.call('XADD', L.wake, 'MAXLEN', '~', 100, '*', 'queue', qkey)
      end
    end
  end
  return out
end
