-- #include _layout.lua
-- Entries in every queue (each priority's loose queue and batch queues): what max_queue_len bounds.
local function queue_depth(L)
  local n = 0
  for _, p in ipairs(L.priorities) do
    n = n + redis.call('XLEN', L.queue[p])
    for _, q in ipairs(redis.call('ZRANGE', L.registry[p], 0, -1)) do n = n + redis.call('XLEN', q) end
  end
  return n
end
