-- #include _queue_depth.lua
-- Write jobs to one queue: the body of SUBMIT_JOB (one job) and of SUBMIT_JOBS (many jobs of one queue in one
-- call, so what is the same for each, the layout's decoding, the model's lookup, the depth read, the queue's
-- registry and ready entries and the depth counter's HINCRBY, is done once a call instead of once a job).

-- The layout of the queues a job naming `name` waits on: '' -> the default queues; a declared name -> its
-- model's; nil when the name is not declared. Before any model is declared ({ns}:models missing) every job
-- waits on the default queues, as before routing existed.
local function route(L, name)
  if not name or name == '' then return L end
  local id = redis.call('HGET', L.model_names, name)
  if id then return model_layout(L, id) end
  if redis.call('EXISTS', L.models) == 0 then return L end
  return nil
end

-- {-3, JSON list of the declared model ids}: what a job naming an undeclared model gets, nothing written.
local function not_declared(L)
  local ids = redis.call('HKEYS', L.models)
  if #ids == 0 then return {-3, '[]'} end
  return {-3, cjson.encode(ids)}
end

-- A batch's queue joins the batch record's `queues` (JSON list): a batch may span models, and the batch
-- counters take each of its queues out of its registry when it ends (_bump_batch.lua).
local function add_batch_queue(L, batch_id, qkey)
  local bkey = key(L.batch, batch_id)
  if redis.call('EXISTS', bkey) == 0 then return end
  local cur = redis.call('HGET', bkey, 'queues')
  local list = {}
  if cur and cur ~= '' then list = cjson.decode(cur) end
  for _, q in ipairs(list) do if q == qkey then return end end
  table.insert(list, qkey)
  redis.call('HSET', bkey, 'queues', cjson.encode(list))
end

-- job(i) -> record key, job_id, request JSON, custom_id ('' = none) of the i-th of n jobs; M: the layout of the
-- queues they go to (route()).
-- Returns a table of n replies ({1, entry_id} | {0, status} | {-1, depth} | {-2, batch_id}: SUBMIT_JOB's), or
-- an error reply for a priority not in the layout.
-- Any existing key refuses that job (EXISTS, not HGET status): a job is never reset or overwritten.
local function submit_jobs(L, M, prio, batch_id, now, limit, ttl, group, n, job)
  if not M.queue[prio] then
    return redis.error_reply('ERR submit: priority must be one of ' .. table.concat(M.priorities, ', ') ..
                             ', got ' .. prio)
  end
  local qkey, rkey = M.queue[prio], M.registry[prio]
  if batch_id ~= '' then qkey = key(M.batch_queue[prio], batch_id) end
  local out, added, depth, made = {}, 0, nil, false
  for i = 1, n do
    local record, job_id, request, custom_id = job(i)
    if redis.call('EXISTS', record) == 1 then
      local cur = redis.call('HMGET', record, 'status', 'batch_id')
      if batch_id ~= '' and cur[2] ~= batch_id then out[i] = {-2, cur[2] or ''} else out[i] = {0, cur[1] or ''} end
    else
      if depth == nil then depth = queue_depth(M) end  -- O(1): the counter, not a sum over the queues
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
    redis.call('HINCRBY', M.depth, prio, added)
    if batch_id ~= '' then
      if redis.call('ZADD', rkey, 'NX', now, qkey) == 1 then add_batch_queue(L, batch_id, qkey) end
      if redis.call('ZADD', M.ready[prio], 'NX', redis.call('ZSCORE', rkey, qkey), qkey) == 1 then
        redis.call('XADD', M.wake, 'MAXLEN', '~', 100, '*', 'queue', qkey)
      end
    end
  end
  return out
end
