-- DROP_ENTRY (worker)
-- Acknowledge and delete an entry that names no job to end (a malformed entry, or a second entry of a job the
-- worker runs already), counted in the depth counter like every other XACK + XDEL of a queue entry.
-- KEYS: 1 the entry's queue. ARGV: 1 group, 2 entry id, 3 the namespace's layout (JSON, _layout.lua)
-- returns 1 (the entry was still there) | 0 (gone already: nothing changed)
-- #include _queue_depth.lua
local L = layout_of_queue(cjson.decode(ARGV[3]), KEYS[1])  -- the depth counter of the entry's model
depth_init(L)
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
local deleted = redis.call('XDEL', KEYS[1], ARGV[2])
pending_add(L, KEYS[1], -acked)
depth_add(L, KEYS[1], -deleted)
return deleted
