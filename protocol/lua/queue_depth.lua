-- QUEUE_DEPTH (client)
-- KEYS: 1 {ns}:config, only to route the call to the namespace's shard on a Redis Cluster (nothing is read from
--       it; on a single Redis a call with no KEYS works too): the counter is found from the layout.
-- ARGV: 1 the namespace's layout (JSON, _layout.lua), 2 (optional) a model's id ('' = the default queues)
-- Returns {entries in every queue, pending (delivered, not acked), entries of each priority in layout order}
-- of that model's queues: its depth counter ({ns}:depth or {ns}:m:{id}:depth; recounted first if it is
-- missing), read in O(1).
-- #include _queue_depth.lua
local L = model_layout(cjson.decode(ARGV[1]), ARGV[2])
local total = queue_depth(L)
local out = {total, tonumber(redis.call('HGET', L.depth, 'pending') or 0)}
for _, v in ipairs(redis.call('HMGET', L.depth, unpack(L.priorities))) do table.insert(out, tonumber(v or 0)) end
return out
