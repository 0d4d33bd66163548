-- QUEUE_DEPTH (client)
-- KEYS: 1 {ns}:config, only to route the call to the namespace's shard on a Redis Cluster (nothing is read from
--       it; on a single Redis a call with no KEYS works too): the counter is found from the layout.
-- ARGV: 1 the namespace's layout (JSON, _layout.lua).
-- Returns {entries in every queue, pending (delivered, not acked), entries of each priority in layout order}:
-- the depth counter {ns}:depth (recounted first if it is missing), read in O(1).
-- #include _queue_depth.lua
local L = cjson.decode(ARGV[1])
local total = queue_depth(L)
local out = {total, tonumber(redis.call('HGET', L.depth, 'pending') or 0)}
for _, v in ipairs(redis.call('HMGET', L.depth, unpack(L.priorities))) do table.insert(out, tonumber(v or 0)) end
return out
