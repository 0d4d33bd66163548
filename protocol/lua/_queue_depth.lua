-- #include _layout.lua
-- The depth counter {ns}:depth (hash): field <priority> = entries in that priority's queues (loose and batch:
-- queued + running), field `pending` = entries READ delivered and not acknowledged yet. Every script that
-- XADDs, XDELs or XACKs a queue entry changes it in the same script by what Redis answers (XDEL and XACK
-- answer 0 when repeated), so it stays exact under retries, reclaims and crashes, and reading it costs the
-- same with 1 or 1,000 live batches. A missing counter (a namespace written before it existed, or the key
-- lost) is recounted from the queues once, by the first script that needs it.

-- The priority whose queue `q` is (its loose queue or a batch queue of it); nil: not a queue of this namespace.
local function priority_of(L, q)
  for _, p in ipairs(L.priorities) do
    if q == L.queue[p] then return p end
    local t = L.batch_queue[p]
    if #q > #t[1] + #t[2] and string.sub(q, 1, #t[1]) == t[1] and (t[2] == '' or string.sub(q, -#t[2]) == t[2])
    then return p end
  end
  return nil
end

local function depth_init(L)
  if redis.call('EXISTS', L.depth) == 1 then return end
  local fields, pending = {}, 0
  for _, p in ipairs(L.priorities) do
    local n = 0
    local qs = {L.queue[p]}
    for _, q in ipairs(redis.call('ZRANGE', L.registry[p], 0, -1, 'WITHSCORES')) do table.insert(qs, q) end
    for i, q in ipairs(qs) do
      -- qs: the loose queue, then member, score, member, score ... of the registry
      if i == 1 or i % 2 == 0 then
        if redis.call('TYPE', q).ok == 'stream' then
          local len = redis.call('XLEN', q)
          n = n + len
          for _, g in ipairs(redis.call('XINFO', 'GROUPS', q)) do
            for j = 1, #g, 2 do if g[j] == 'pending' then pending = pending + g[j + 1] end end
          end
          if i > 1 and len > 0 then redis.call('ZADD', L.ready[p], 'NX', qs[i + 1], q) end
        end
      end
    end
    table.insert(fields, p)
    table.insert(fields, n)
  end
  redis.call('HSET', L.depth, 'pending', pending, unpack(fields))
end

-- Add n to the depth of queue q's priority (entries written or deleted); a stream outside the layout is not counted.
local function depth_add(L, q, n)
  local p = priority_of(L, q)
  if p and n ~= 0 then redis.call('HINCRBY', L.depth, p, n) end
end

local function pending_add(L, q, n)
  if n ~= 0 and priority_of(L, q) then redis.call('HINCRBY', L.depth, 'pending', n) end
end

-- XACK + XDEL one entry of queue q, counted.
local function ack_del(L, q, group, entry)
  pending_add(L, q, -redis.call('XACK', q, group, entry))
  depth_add(L, q, -redis.call('XDEL', q, entry))
end

-- Entries in every queue: what max_queue_len bounds.
local function queue_depth(L)
  depth_init(L)
  local n = 0
  for _, v in ipairs(redis.call('HMGET', L.depth, unpack(L.priorities))) do n = n + tonumber(v or 0) end
  return n
end
